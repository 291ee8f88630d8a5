"""inflight.py: in-flight weight updates on inference ranks (--rollout.inflight-updates N). A generator samples its
batch N tokens at a time and, between chunks, loads the newest weights the trainers have pushed; the completions in
progress continue under them (partial rollouts: AReaL's interruptible generation, arXiv 2505.24298; docs/async.md
compares PipelineRL's). Every token keeps the log-prob it was sampled with and the version that sampled it, so the
sampler correction stays exact per token."""
import itertools

from rollout import Completion, later_seed


def continued(prompt, tokens):
    """An engine prompt followed by the tokens sampled so far, as token ids (an image prompt's text form is dropped:
    vLLM would read it instead of the ids; it expands the image's placeholder from the ids itself)."""
    return {**{k: v for k, v in prompt.items() if k != "prompt"},
            "prompt_token_ids": list(prompt["prompt_token_ids"]) + tokens}


def generate_in_chunks(generate, refresh, chunk, prompts, *, n, temperature, top_p=1.0, top_k=0, max_tokens=128,
                       seeds=None):
    """engine.generate's contract, `chunk` tokens at a time: refresh() runs before each chunk (it may load newer
    weights) and returns the engine's version. Each Completion gets `versions`: [t] the version that sampled each
    token. The first chunk is the one-piece call cut at `chunk` tokens (n per prompt); then each running completion
    continues from its prompt + its tokens so far (after a weight load, a full prefill under the new weights)."""
    limits = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    version, sampling = refresh(), dict(temperature=temperature, top_p=top_p, top_k=top_k)
    first = generate(prompts, n=n, **sampling, seeds=seeds, max_tokens=[min(chunk, m) for m in limits])
    done = {(i, j): Completion(c.token_ids, c.logprobs, c.truncated, [version] * len(c.token_ids))
            for i, group in enumerate(first) for j, c in enumerate(group)}
    for c in itertools.count(1):
        live = [(i, j) for i, j in done if done[i, j].truncated and len(done[i, j].token_ids) < limits[i]]
        if not live:  # (stopped, or at its own limit: `truncated` is then the last chunk's, i.e. the whole one's)
            return [[done[i, j] for j in range(n)] for i in range(len(prompts))]
        version = refresh()
        outs = generate([continued(prompts[i], done[i, j].token_ids) for i, j in live], n=1, **sampling,
                        max_tokens=[min(chunk, limits[i] - len(done[i, j].token_ids)) for i, j in live],
                        seeds=[[later_seed(seeds[i][j], "chunk", c)] for i, j in live] if seeds else None)
        for key, [o] in zip(live, outs):
            d = done[key]
            d.token_ids, d.logprobs, d.truncated = d.token_ids + o.token_ids, d.logprobs + o.logprobs, o.truncated
            d.versions += [version] * len(o.token_ids)


def version_spread(samples):
    """-> (the most versions one sample's sampled tokens span, minus 1: async/version_spread_max; how many samples
    were continued across a weight update: async/partial_frac's numerator)."""
    spans = [max(v) - min(v) for s in samples if (v := [x for x in s.get("engine_versions", ()) if x >= 0])]
    return max(spans, default=0), sum(x > 0 for x in spans)
