"""Agents: multi-turn episodes of a policy with tools and text environments, token-native.

Why a package of its own: an episode is the unit of rollout for agentic RL, and its
bookkeeping (which tokens the policy sampled, with which log-probs and weight version, and
which ones the chat template and the environment added) must be exact, or training drifts
from what was sampled. ``episode`` is the record, ``render`` the chat template's tokens
between turns, ``tool_calls`` and ``tools`` the Hermes/Qwen tool-call format and typed tool
functions, ``env`` the text-environment protocol, ``loop`` one episode against a generator.
"""
