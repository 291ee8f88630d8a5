"""probe.py: the weight-transfer check of --rollout.inference-ranks: one fixed sequence that the trainers and the
generators' engines score at every weight version (it works when every sample is stale). Each batch carries its
engine's scores of every version it was sampled with (in-flight updates: each one loaded between chunks); the
trainers compare them with their own (async/probe_mismatch) and stop past --rollout.max-mismatch, so a transfer that
did not land cannot train silently."""
import math

import torch

import rollout
import token_logprobs

PROBE = ("what is 12 + 30? answer:", " 12 + 30 = 42, so the answer is 42.")  # prompt, completion (plain ascii)


def probe_ids(processor):
    tok = getattr(processor, "tokenizer", processor)
    return [tok.encode(text, add_special_tokens=False) for text in PROBE]  # [prompt ids, completion ids]


@torch.no_grad()
def trainer_probe(run):
    """(trainers, a collective: the FSDP2 forward) The policy's log-probs of the probe's completion tokens at
    temperature 1, no truncation, no placeholder bias (vLLM's prompt log-probs take none) -> [T] float64."""
    prompt, completion = probe_ids(run.processor)
    pad = getattr(run.processor, "tokenizer", run.processor).pad_token_id
    mb = token_logprobs.collate([{"prompt_ids": prompt, "completion_ids": completion}], pad, run.device, len(completion))
    banned, run.module.banned = run.module.banned, []
    try:
        return run.module(mb, 1.0)[0][0].double().cpu()  # [T]
    finally:
        run.module.banned = banned


@torch.no_grad()
def engine_probe(engine, processor):
    """(generators; every engine rank calls it) The engine's log-probs of the same tokens, from raw logits -> [T]."""
    prompt, completion = probe_ids(processor)
    ids = prompt + completion
    if isinstance(engine, rollout.VLLMEngine):  # prompt_logprobs: each prompt token given the ones before it
        from vllm import SamplingParams
        out = engine.llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, temperature=0.0,
                                  prompt_logprobs=0, detokenize=False), use_tqdm=False,
                                  lora_request=engine.lora_request())[0]  # --lora.sync adapter: with the adapter
        return [out.prompt_logprobs[i][t].logprob for i, t in enumerate(ids) if i >= len(prompt)]
    logits = engine.model(torch.tensor([ids], device=engine.device)).logits[0, len(prompt) - 1:-1].float()  # [T, V]
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion, device=logits.device)[:, None])[:, 0].tolist()


def probe_gap(link, msg):
    """Mean |engine - trainer| over the probe's tokens at each version the batch was sampled with (the one it began
    with and each loaded between its chunks) -> (the largest, inf when not finite; its version)."""
    gaps = [((link.probes[v] - torch.tensor(p, dtype=torch.float64)).abs().mean().item(), v) for v, p in msg["probes"]]
    return max((g if math.isfinite(g) else math.inf, v) for g, v in gaps)


def check_probe(run, version, gap):
    """--rollout.max-mismatch on the probe: every trainer holds the same global gap, so all raise together."""
    limit = run.cfg.rollout.max_mismatch
    if limit and not gap <= limit:
        raise RuntimeError(
            f"weight transfer check failed at version {version} (the policy after {version} steps): the inference "
            f"ranks' engine scores a fixed probe sequence {gap:.3g} nats per token away from the trainers' scores of "
            f"it (mean absolute; --rollout.max-mismatch {limit}): the generators sample with weights that are not the "
            "policy's. Likely causes: a weight push that did not land or landed wrong (a tensor skipped, mapped onto "
            "the wrong engine parameter, corrupted in transit), an engine that changes weights on load (quantization, "
            "another dtype), or a different model on each side. Fix it, or raise --rollout.max-mismatch (0 = off).")
