"""Runs grpo.main with --rollout.inference-ranks and a fixed probe sequence scored on both sides of every weight
transfer: each trainer push of version v records the trainer's log-probs of the probe's completion tokens (the FSDP2
module, all trainers), and each version a generator applies records its engine's log-probs of the same tokens (vLLM
prompt_logprobs, or the HF engine's forward). <output-dir>/probe_{trainer,generator}.jsonl; tests/test_async.py
compares them."""
import json
import os
from types import SimpleNamespace

import torch
import tyro

import grpo
import inference_ranks

PROBE_PROMPT, PROBE_COMPLETION = "max digit of 3 9 4 7: ", "9 is the largest digit"


def probe_ids(run):
    tok = getattr(run.processor, "tokenizer", run.processor)
    return tok.encode(PROBE_PROMPT, add_special_tokens=False), tok.encode(PROBE_COMPLETION, add_special_tokens=False)


def record(run, role, version, logps):
    if run.rank == 0:
        with open(os.path.join(run.cfg.output_dir, f"probe_{role}.jsonl"), "a") as f:
            f.write(json.dumps({"version": version, "logps": logps}) + "\n")


def trainer_logps(run):
    prompt, completion = probe_ids(run)
    batch = SimpleNamespace(samples=[{"prompt_ids": prompt, "completion_ids": completion}], T=len(completion))
    return grpo.logps_of(run, run.module, batch, torch.arange(1))["logps"][0].tolist()  # temperature as configured (1)


def engine_logps(run):
    prompt, completion = probe_ids(run)
    ids = prompt + completion
    if hasattr(run.engine, "llm"):  # vLLM: the log-prob of each prompt token given the ones before it
        from vllm import SamplingParams
        out = run.engine.llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                                      lora_request=run.engine.lora_request(),
                                      use_tqdm=False)[0]
        return [out.prompt_logprobs[i][t].logprob for i, t in enumerate(ids) if i >= len(prompt)]
    with torch.no_grad():  # HF engine
        logits = run.engine.model(torch.tensor([ids])).logits[0, len(prompt) - 1:-1].float()
        return logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist()


real_push, real_apply = inference_ranks.push_weights, inference_ranks.apply_version


def push_and_probe(run, version):
    seconds = real_push(run, version)
    record(run, "trainer", version, trainer_logps(run))  # collective among trainers (FSDP2 forward)
    return seconds


def apply_and_probe(run, staged, cond, needed):
    before = run.link.version
    got = real_apply(run, staged, cond, needed)  # (version, seconds waited, evaluate?) or None at the stop marker
    if got and (got[0] != before or not os.path.exists(os.path.join(run.cfg.output_dir, "probe_generator.jsonl"))):
        record(run, "generator", got[0], engine_logps(run))
    return got


real_load = inference_ranks.load_staged


def load_and_probe(run, todo):  # every load, between batches or (--rollout.inflight-updates) between decode chunks
    real_load(run, todo)
    if todo[-1][2] != "ema":
        record(run, "generator", run.link.version, engine_logps(run))


inference_ranks.push_weights, inference_ranks.apply_version = push_and_probe, apply_and_probe
inference_ranks.load_staged = load_and_probe
grpo.main(tyro.cli(grpo.Config))
