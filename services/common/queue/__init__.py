"""The work queue behind rollout, reward and refcritic: Redis Streams with consumer groups.

Why streams: an entry stays pending until a worker acks it, so a worker dying mid-job loses
nothing, and ``XAUTOCLAIM`` lets a live worker take it over. An entry delivered more than
``max_deliveries`` times is poison: it goes to a dead-letter stream and its request gets an
error answer, so a bad input cannot crash workers forever nor leave a waiter hanging.
Answers are stored with ``SET NX`` under ``Keys.result(request_id)``: the first answer wins, so
a retried request is answered once. Completed entries are acked *and* deleted, so a stream
holds only outstanding work, which ``Backlog.move_to`` can hand from a dead replica to a live
one.

This package is the one owner of that protocol: every read and write of stream entries,
result keys, notify keys and request bindings goes through it. Its rooms:

- ``entries``: what an entry holds (its field names, also spliced into the Lua that writes
  entries, the router's enqueue step included) and the ``Job`` a delivery becomes;
- ``scripts``: the Lua steps, each saying what it makes atomic;
- ``answers.Answers``: what is keyed by a request id alone, on whatever stream the request
  went: stored answers, waiting for them (one or many), bindings, waiters, the data epoch
  (the router, which queues on many replicas' streams, waits through one of these);
- ``stream.QueueStream``: one stream and its group (settings, health, the atomic answer step
  and dead-lettering, which every side needs), on ``Answers``;
- ``producer.Producer``: submit, bind, withdraw;
- ``consumer.Consumer``: read, answer (fenced), keep alive, reclaim, cancellation marks;
- ``backlog.Backlog``: the outstanding entries as a whole: move, drain, recount, trim;
- ``results``: an answer as stored (a payload, or an error code and message);
- ``workqueue.WorkQueue``: all three sides on one object, for code that plays every part of
  one stream (tests, tools, the router over its replicas' streams).

The job toolkit every pool of workers is built from sits on those sides:

- ``workers``: ``JobWorker`` (one consumer: take, handle, answer, keep alive, reclaim) and
  ``JobWorkerPool`` (the worker tasks of one process);
- ``scatter.ScatterGather``: a batch of payloads in, their answers out, in order;
- ``local_first``: a front door serves a request in-process when one of its workers is idle
  (``WorkerSlots``, ``LocalFirst``), else through the stream, cut for the idle workers
  (``IdleWorkers``, ``parts_for``).

Request ids are idempotency keys: unique within a cluster for ``result_ttl_s``. The Redis
client must not decode responses (payloads are bytes); its socket timeout, if any, must exceed
``poll_s`` and ``block_ms``.
"""
