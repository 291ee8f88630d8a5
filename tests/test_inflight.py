"""In-flight weight updates (--rollout.inflight-updates, inflight.py): chunked generation across a weight change with
the real HF engine, each token's behaviour log-prob against a float32 recompute under the version that sampled it;
end to end on an inference rank with the real vLLM engine (test_async-style torchrun + gloo)."""
import json
import math
import re

import pytest
import torch

import inflight
import rollout
from conftest import torchrun
from test_grpo import metrics


def recompute(model, prompt, tokens):
    """log p(token_t | prompt, tokens_<t) under `model` at temperature 1, float32 -> [t]."""
    ids = torch.tensor([prompt + tokens])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


@torch.no_grad()
def test_a_completion_spanning_a_version_change_keeps_each_tokens_behaviour_logprob(text_dir):
    engine = rollout.HFEngine(text_dir, seed=0)
    v0 = {n: t.clone() for n, t in engine.model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    v1 = {n: t + 0.5 * t.std() * torch.randn(t.shape, generator=g) if t.dim() == 2 else t for n, t in v0.items()}
    calls = []

    def refresh():  # version 1 arrives after the first chunk
        calls.append(1)
        if len(calls) == 2:
            engine.load_weights(iter(v1.items()))
        return 0 if len(calls) == 1 else 1

    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9, 3]}]
    outs = inflight.generate_in_chunks(engine.generate, refresh, 3, prompts, n=2, temperature=1.0, max_tokens=8,
                                       seeds=[[11, 12], [13, 14]])
    ref = rollout.HFEngine(text_dir, seed=0).model
    spanned = 0
    for p, group in zip(prompts, outs):
        for c in group:
            assert len(c.versions) == len(c.token_ids) == len(c.logprobs) and 0 < len(c.token_ids) <= 8
            got = torch.tensor(c.logprobs)
            for version, weights in ((0, v0), (1, v1)):
                ref.load_state_dict(weights)
                want = recompute(ref, p["prompt_token_ids"], c.token_ids)
                picked = torch.tensor(c.versions) == version
                torch.testing.assert_close(got[picked], want[picked], atol=1e-5, rtol=0)
                assert not torch.allclose(got[~picked], want[~picked], atol=1e-3) or not (~picked).any()
            spanned += len(set(c.versions)) > 1
            assert c.versions == sorted(c.versions) and c.versions[:3] == [0] * min(3, len(c.versions))
    assert spanned > 0  # at least one completion continued under the new weights
    assert inflight.version_spread([{"engine_versions": c.versions} for o in outs for c in o])[0] == 1


def test_chunks_stop_where_one_piece_stops(text_dir, tmp_path):
    """Limits, stops and `truncated` equal the one-piece call's (same weights: only the seeds of later chunks differ,
    so compare the shape of the result, and greedy for the tokens). Greedy on the tiny model never stops (it repeats
    a token), so stops are checked sampled, on a copy that stops on every 4th token id: a completion ends at its first
    stop id (in whichever chunk) with truncated False, or runs to its limit free of stop ids with truncated True."""
    from tiny_models import stopping_copy
    engine = rollout.HFEngine(text_dir, seed=0)
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9]}]
    whole = engine.generate(prompts, n=1, temperature=0.0, max_tokens=[7, 4])
    chunked = inflight.generate_in_chunks(engine.generate, lambda: 0, 2, prompts, n=1, temperature=0.0,
                                          max_tokens=[7, 4], seeds=[[1], [2]])
    for a, b in zip(whole, chunked):
        assert a[0].token_ids == b[0].token_ids and a[0].truncated == b[0].truncated
        torch.testing.assert_close(torch.tensor(a[0].logprobs), torch.tensor(b[0].logprobs), atol=1e-5, rtol=0)
    engine = rollout.HFEngine(stopping_copy(text_dir, tmp_path / "stops", every=4), seed=0)
    stop, limits = set(engine.stop_ids), [9, 6]
    chunked = inflight.generate_in_chunks(engine.generate, lambda: 0, 2, prompts, n=8, temperature=1.0,
                                          max_tokens=limits, seeds=[list(range(8)), list(range(8, 16))])
    later = 0
    for group, limit in zip(chunked, limits):
        for c in group:
            inside = [t in stop for t in c.token_ids[:-1]]
            assert not any(inside) and len(c.token_ids) <= limit, c
            assert c.truncated == (c.token_ids[-1] not in stop) and (not c.truncated or len(c.token_ids) == limit), c
            later += not c.truncated and len(c.token_ids) > 2
    assert later > 0  # some completion stopped in a chunk after the first


def test_inflight_updates_on_an_inference_rank(tmp_path):
    """1 trainer + 1 generator (real vLLM) at S = 1, one token per chunk: the run finishes, no sample is older than S
    versions and none spans more than S + 1 versions, the new metrics are logged, and every version the generator
    loaded (between batches or between chunks) scores the probe as the trainer's policy of that version did."""
    import json
    out = tmp_path / "run"
    torchrun("tests/async_probe.py", "--output-dir", str(out), "--max-steps", "8", "--rollout.max-staleness", "1",
             "--rollout.inflight-updates", "1", "--rollout.inference-ranks", "1", "--log.completions-every", "0",
             nproc=2, timeout=600)
    rows = [r for r in metrics(str(out)) if r["step"] > 0]
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert max(r["async/staleness_max"] for r in rows) <= 1 and max(r["async/version_spread_max"] for r in rows) <= 1
    assert all(0 <= r["async/partial_frac"] <= 1 and math.isfinite(r["async/probe_mismatch"]) for r in rows)
    mismatch = [r["logprob_mismatch/mean_abs"] for r in rows if math.isfinite(r["logprob_mismatch/mean_abs"])]
    assert mismatch and max(mismatch) <= 1e-3  # the fresh samples' (NaN on a step with none; step 1's: all fresh)
    read = lambda role: {r["version"]: r["logps"] for r in map(json.loads, open(out / f"probe_{role}.jsonl"))}  # noqa: E731
    trainer, generator = read("trainer"), read("generator")
    assert len(generator) >= 4 and set(generator) <= set(trainer)
    for v, lp in generator.items():
        assert max(abs(a - b) for a, b in zip(lp, trainer[v])) <= 1e-3, (v, lp, trainer[v])


@pytest.mark.parametrize("args,message", [
    (["--rollout.inflight-updates", "4"], "needs --rollout.inference-ranks"),
    (["--rollout.inflight-updates", "-1", "--rollout.inference-ranks", "1"], "tokens per chunk"),
])
def test_inflight_flag_checks(tmp_path, args, message):
    """In process, as tests/test_grpo.py::test_config_checks: flags.validate, which grpo.py runs on every rank before
    any collective (the refusal's exit on every rank: tests/test_grpo.py::test_bad_inputs_fail_fast_on_every_rank)."""
    import tyro

    import flags
    import grpo
    cfg = tyro.cli(grpo.Config, args=["--output-dir", str(tmp_path / "o"), "--max-steps", "1", *args])
    with pytest.raises(ValueError, match=re.escape(message)):
        flags.validate(cfg, [])


@torch.no_grad()
def test_episode_tokens_carry_the_version_that_sampled_them(tool_model):
    """Multi-turn episodes through chunked generation with a weight change after the first chunk: the per-token
    versions align with the completion (model tokens: the version of their chunk, each one's log-prob equal to a
    recompute under it; inserted environment tokens: -1)."""
    from tools_for_tests import EndlessEnv

    import episodes
    import tasks
    engine = rollout.HFEngine(tool_model, seed=0)
    tok, v0 = engine.tok, {n: t.clone() for n, t in engine.model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    v1 = {n: t + 0.3 * t.std() * torch.randn(t.shape, generator=g) if t.dim() == 2 else t for n, t in v0.items()}
    calls = []

    def refresh():
        calls.append(1)
        if len(calls) == 2:
            engine.load_weights(iter(v1.items()))
        return int(len(calls) > 1)

    whole = engine.generate
    engine.generate = lambda *a, **k: inflight.generate_in_chunks(whole, refresh, 4, *a, **k)
    starts = [{"row": {"prompt": p}} for p in ("12*3?", "45*7?")]
    encode = lambda row, messages: tasks.encode_prompt({"prompt": messages}, tok, 128)["prompt_ids"]  # noqa: E731
    cfg = rollout.RolloutConfig(max_completion_length=40, max_total_length=200, max_turns=3)
    eps = [e for o in episodes.run_episodes(engine, tok, starts, n=2, seeds=rollout.completion_seeds(0, 0, 0, 2, 2),
                                            rollout_cfg=cfg, temperature=1.0, make_env=EndlessEnv, encode=encode)
           for e in o]
    ref = rollout.HFEngine(tool_model, seed=0).model
    inserted = 0
    for e in eps:
        v, m = e["engine_versions"], e["completion_mask"]
        assert len(v) == len(m) == len(e["completion_ids"]) and all((x >= 0) == bool(k) for x, k in zip(v, m))
        inserted += m.count(0)
        for version, weights in ((0, v0), (1, v1)):
            ref.load_state_dict(weights)
            want = recompute(ref, e["prompt_ids"], e["completion_ids"])
            picked = torch.tensor(v) == version
            torch.testing.assert_close(torch.tensor(e["engine_logps"])[picked], want[picked], atol=1e-4, rtol=0)
    assert inserted > 0 and any(1 in e["engine_versions"] for e in eps)


def test_the_mismatch_guard_covers_each_token_the_current_weights_sampled():
    """batching.token_fresh: with per-token versions, the tokens of the step's version count as fresh even in a
    completion that began under an older one (the guard was per sample: NaN on nearly every in-flight step)."""
    import batching
    samples = [{"completion_ids": [1] * 6, "engine_logps": [0.0] * 6, "truncated": False, "staleness": 1,
                "engine_versions": [3, 3, 4, 4, -1, 4]},  # step 4: began under version 3, continued under 4
               {"completion_ids": [1] * 2, "engine_logps": [0.0] * 2, "truncated": False, "staleness": 0},
               {"completion_ids": [1] * 3, "engine_logps": [0.0] * 3, "truncated": False, "staleness": 1}]
    fresh = batching.build_batch(samples, False, "cpu").fresh
    assert fresh.tolist() == [[0, 0, 1, 1, 0, 1], [1] * 6, [0] * 6]


def expected_dynamic_sampling(args, steps):
    """The colocated rule (DAPO as verl's recipe/dapo applies it, per trainer), written out for one trainer and
    answer_parity (odd answer: a signal; even: none): step s, round r reads block s + (extra rounds before s) + r of
    the data order; rounds stop when the batch holds its prompts with a signal or at --dynamic-sampling-max-rounds; the
    first prompts with a signal in (round, position) order are kept, the first without one top the batch up -> per
    step: the kept prompts, the top-up prompts, frac_zero_std (round 0's), rounds, masked (top-up) groups."""
    import numpy as np
    import tyro

    import grpo
    import launch
    cfg = tyro.cli(grpo.Config, args=args)
    rows, _ = launch.load_rows(cfg)
    order = np.random.default_rng(cfg.seed).permutation(len(rows))
    n = cfg.batch_size // cfg.num_generations
    block = lambda b: [rows[int(order[(b * n + i) % len(rows)])] for i in range(n)]  # noqa: E731
    extra, out = 0, []
    for s in range(steps):
        drawn, rnd = [], 0
        while rnd < cfg.dynamic_sampling_max_rounds and sum(int(r["answer"]) % 2 for r in drawn) < n:
            drawn += block(s + extra + rnd)
            rnd += 1
        kept = [r["prompt"] for r in drawn if int(r["answer"]) % 2][:n]
        topped = [r["prompt"] for r in drawn if int(r["answer"]) % 2 == 0][:n - len(kept)]
        out.append({"kept": kept, "topped": topped, "dynamic_sampling/rounds": rnd,
                    "frac_zero_std": sum(int(r["answer"]) % 2 == 0 for r in block(s + extra)) / n,
                    "dynamic_sampling/masked_groups": n - len(kept)})
        extra += rnd - 1
    return out


def test_dynamic_sampling_on_a_generator_with_inflight_updates_resumes_exactly(tmp_path):
    """1 trainer + 1 generator (HF engine: bit-exact sampling), S = 0, --rollout.inflight-updates 2, --dynamic-sampling
    scored and refilled on the generator (answer_parity: which groups carry a signal is known from the answers).
    tests/batch_dump.py records every batch the trainer receives: 8 samples (the batch asked for), the groups with a
    signal exactly the prompts the colocated rule picks (expected_dynamic_sampling), the rest top-ups of groups
    without one, each sample's rewards those of answer_parity; frac_zero_std, rounds and masked groups as the rule
    gives them. 4 steps straight == a copy of its checkpoint-2 (extra rounds before it) resumed for 2 (metrics,
    received batches, weights): the generator takes the count of extra rounds from the trainer's first push."""
    import json
    import os
    import shutil

    from safetensors.torch import load_file
    args = ["--rollout.engine", "hf", "--rollout.inference-ranks", "1", "--rollout.max-staleness", "0",
            "--rollout.inflight-updates", "2", "--dynamic-sampling", "--dynamic-sampling-max-rounds", "2",
            "--data.rewards", "rewards_for_tests:answer_parity", "--dataset", "find_digit", "--seed", "0",
            "--num-generations", "4", "--batch-size", "8", "--optim.lr", "5e-2", "--log.completions-every", "0",
            "--log.no-progress"]
    a, b = tmp_path / "a", tmp_path / "b"
    torchrun("tests/batch_dump.py", "--output-dir", str(a), "--max-steps", "4", "--checkpoint.every", "2", *args,
             timeout=300)
    want = expected_dynamic_sampling(["--output-dir", str(a), *args], 4)
    assert any(w["dynamic_sampling/rounds"] > 1 for w in want[:2])  # extra rounds before the checkpoint
    assert any(w["dynamic_sampling/masked_groups"] for w in want)
    received = [json.loads(x) for x in open(a / "received-rank0.jsonl")]
    rows = [r for r in metrics(str(a)) if r["step"] > 0]
    assert [r["step"] for r in received] == [0, 1, 2, 3] and [r["step"] for r in rows] == [1, 2, 3, 4]
    for got, w, row in zip(received, want, rows):
        groups = [got["samples"][i:i + 4] for i in range(0, len(got["samples"]), 4)]
        assert len(got["samples"]) == 8 and all(len({s[0] for s in g}) == 1 for g in groups)
        assert [g[0][0] for g in groups if not g[0][2]] == w["kept"], (got, w)
        topped = [g for g in groups if g[0][2]]
        assert [g[0][0] for g in topped] == w["topped"] and all(s[2] for g in topped for s in g)
        for g in groups:  # answer_parity by position in the group: its rewards, scored on the generator
            odd = int(g[0][1]) % 2
            assert [s[3] for s in g] == [[float(i % 2)] if odd else [1.0] for i in range(4)], g
        assert {k: row[k] for k in w if k not in ("kept", "topped")} == {
            k: v for k, v in w.items() if k not in ("kept", "topped")}, (row, w)
        assert row["frac_zero_std/in_loss"] == 0.0 and row["reward/mean"] == 0.5 and row["async/staleness_max"] == 0
    os.makedirs(b)
    shutil.copytree(a / "checkpoint-2", b / "checkpoint-2")
    (b / "metrics.jsonl").write_text("".join(open(a / "metrics.jsonl").readlines()[:2]))
    torchrun("tests/batch_dump.py", "--output-dir", str(b), "--max-steps", "4", "--checkpoint.every", "2",
             "--resume", "latest", *args, timeout=300)
    skip = ("time/", "tokens_per_s", "mem/", "async/trainer_wait_s", "async/generator_wait_s", "sync/bytes")
    rb = metrics(str(b))
    assert [r["step"] for r in rb] == [1, 2, 3, 4]
    drop = lambda row: {k: v for k, v in row.items() if not k.startswith(skip)}  # noqa: E731
    assert [drop(x) for x in rows[2:]] == [drop(y) for y in rb[2:]]
    assert [json.loads(x) for x in open(b / "received-rank0.jsonl")] == received[2:]
    pa, pb = (load_file(os.path.join(d, "checkpoint-4", "model.safetensors")) for d in (a, b))
    assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


@torch.no_grad()
def test_every_version_loaded_between_chunks_is_probed(text_dir):
    """The runtime weight check covers every version a batch was sampled with, not only the last: a generator (the
    real HF engine, inference_ranks.refresh as between chunks) begins a batch at version 0, loads version 1 broken in
    transit (the final norm x 3) and then an intact version 2 before the send. The batch's probes hold all three; the
    trainers' check, against a second copy of the model holding each version's true weights, stops naming version 1
    (with only the last version probed, the gap is ~0 and the batch trains)."""
    import threading
    from datetime import timedelta
    from types import SimpleNamespace

    import inference_ranks
    import probe
    engine, trainer = rollout.HFEngine(text_dir, seed=0), rollout.HFEngine(text_dir, seed=0)
    g = torch.Generator().manual_seed(1)
    true = [{n: t.clone() for n, t in engine.model.state_dict().items()}]
    for _ in range(2):
        true.append({n: t + 0.2 * t.std() * torch.randn(t.shape, generator=g) if t.dim() == 2 else t
                     for n, t in true[-1].items()})
    link = inference_ranks.Link("generator", 1, 2, 1, 1, timedelta(seconds=60), None, None, torch.device("cpu"))
    run = SimpleNamespace(engine=engine, processor=engine.tok, link=link, cfg=SimpleNamespace(
        rollout=SimpleNamespace(max_mismatch=0.1)))
    link.version, link.probed = 0, {0: probe.engine_probe(engine, engine.tok)}
    staged, cond = {"versions": [], "error": None}, threading.Condition()
    broken = {**true[1], "model.norm.weight": true[1]["model.norm.weight"] * 3}
    for version, tensors in ((1, broken), (2, true[2])):  # one arrives before each later chunk
        staged["versions"].append((version, tensors, False))
        assert inference_ranks.refresh(run, staged, cond) == version
    msg = {"probes": sorted(link.probed.items())}  # as send_batch sends them
    assert [v for v, _ in msg["probes"]] == [0, 1, 2]
    trainers = SimpleNamespace(probes={})
    for v, weights in enumerate(true):
        trainer.model.load_state_dict(weights)
        trainers.probes[v] = torch.tensor(probe.engine_probe(trainer, trainer.tok), dtype=torch.float64)
    gap, version = probe.probe_gap(trainers, msg)
    assert version == 1 and gap > 0.1
    assert probe.probe_gap(trainers, {"probes": msg["probes"][-1:]})[0] < 1e-5  # the last version alone: intact
    with pytest.raises(RuntimeError, match="weight transfer check failed at version 1 "):
        probe.check_probe(run, version, gap)


def test_dynamic_sampling_on_two_generators_pools_them_as_colocated(tmp_path):
    """1 trainer + 2 HF-engine generators, S = 0, --dynamic-sampling (answer_parity): each engine holds a contiguous
    slice of the trainer's prompts, and the two pool their rule over the trainer's batch (a count per round over
    their gloo group): the batch the trainer receives is the colocated rule's (expected_dynamic_sampling, one
    trainer): the same kept prompts and top-ups in the same order, rounds, frac_zero_std and masked groups on every
    step. (Run per engine, each slice keeps its own first groups and rounds go on while either slice is short: with
    seed 10 that keeps other prompts on steps 2 and 3, with other rounds and top-ups.)"""
    args = ["--rollout.engine", "hf", "--rollout.inference-ranks", "2", "--rollout.max-staleness", "0",
            "--dynamic-sampling", "--dynamic-sampling-max-rounds", "3",
            "--data.rewards", "rewards_for_tests:answer_parity", "--dataset", "find_digit", "--seed", "10",
            "--num-generations", "4", "--batch-size", "16", "--optim.lr", "5e-2", "--log.completions-every", "0",
            "--log.no-progress", "--max-steps", "3"]
    out = tmp_path / "a"
    torchrun("tests/batch_dump.py", "--output-dir", str(out), *args, nproc=3, timeout=600)
    want = expected_dynamic_sampling(["--output-dir", str(out), *args], 3)
    received = [json.loads(x) for x in open(out / "received-rank0.jsonl")]
    rows = [r for r in metrics(str(out)) if r["step"] > 0]
    got = []
    for r, row in zip(received, rows, strict=True):
        groups = [r["samples"][i:i + 4] for i in range(0, len(r["samples"]), 4)]
        got.append({"kept": [g[0][0] for g in groups if not g[0][2]], "topped": [g[0][0] for g in groups if g[0][2]],
                    **{k: row[k] for k in ("dynamic_sampling/rounds", "frac_zero_std", "dynamic_sampling/masked_groups")}})
        n = len(groups)
        assert [i for i, g in enumerate(groups) if g[0][2]] == [j * n // len(got[-1]["topped"])
                                                                 for j in range(len(got[-1]["topped"]))]
    assert len(got) == 3 and got == want, (got, want)


def test_a_version_loaded_mid_batch_continues_exactly_and_the_metrics_see_it(tmp_path):
    """tests/inflight_forced.py makes each batch that began a version behind wait, before its second chunk, until the
    step's version is staged, so a version is loaded between chunks on every such step (real vLLM, chunks of 34
    tokens: past one 32-token KV block, so the prefix cache holds blocks the old weights computed). The completions
    span two versions, async/version_spread_max and async/partial_frac equal a recount from the received batches, and
    the tokens continued under the step's version match the trainer (without the engine's prefix-cache reset on a
    load: 0.05-0.07 nats). Found by review: the other end-to-end tests pass with chunking or loading switched off."""
    out = tmp_path / "run"
    torchrun("tests/inflight_forced.py", "--output-dir", str(out), "--max-steps", "4", "--rollout.engine", "vllm",
             "--rollout.inference-ranks", "1", "--rollout.max-staleness", "1", "--rollout.inflight-updates", "34",
             "--rollout.max-completion-length", "48", "--eval.every", "0", "--log.completions-every", "0",
             "--log.no-progress", timeout=600)
    rows = [r for r in metrics(str(out)) if r["step"] > 0]
    received = [json.loads(x) for x in open(out / "received-rank0.jsonl")]
    spans = [[max(v) - min(v) for v in r["versions"] if v] for r in received]
    assert any(any(s) for s in spans), spans  # some completion continued under the step's version
    for r, s in zip(rows, spans, strict=True):
        assert r["async/version_spread_max"] == max(s) and r["async/staleness_max"] <= 1
        assert abs(r["async/partial_frac"] - sum(x > 0 for x in s) / len(s)) < 1e-9
    assert all(r["logprob_mismatch/mean_abs"] <= 1e-3 for r in rows), [r["logprob_mismatch/mean_abs"] for r in rows]


def test_version_spread_skips_inserted_tokens_and_each_chunk_has_its_own_seed():
    """Inserted episode tokens (version -1) are no sampled version: they neither widen a span nor make a sample
    partial. Each chunk after the first draws from its own stream (the same seed for every chunk would correlate
    the noise across a version change). Found by review: both mutations passed the suite."""
    samples = [{"engine_versions": [-1, 3, 3, -1, 4]}, {"engine_versions": [-1, 5, 5, -1]}, {"engine_versions": [-1]}, {}]
    assert inflight.version_spread(samples) == (1, 1)
    seeds = [rollout.later_seed(123, "chunk", c) for c in range(4)]
    assert seeds[0] == 123 and len(set(seeds)) == 4 and rollout.later_seed(None, "chunk", 2) is None
    assert rollout.later_seed(123, "turn", 1) not in seeds  # an episode's turn 1 is not its chunk 1


@pytest.mark.parametrize("staleness,length,env,idle", [(0, 64, None, "--rollout.max-staleness 0"),
                                                       (1, 4, None, "--rollout.max-complet"), (1, 64, None, None),
                                                       (1, 4, "tools_for_tests:make_counting_env", None)])
def test_inflight_updates_that_cannot_act_are_said_once(monkeypatch, capsys, staleness, length, env, idle):
    """(Episodes take newer weights at a later turn's first chunk, however long the chunks: not idle.)"""
    import flags
    import grpo
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = grpo.Config()
    cfg.rollout.inference_ranks, cfg.rollout.inflight_updates, cfg.rollout.max_staleness = 1, 4, staleness
    cfg.rollout.max_completion_length, cfg.env = length, env
    flags.validate_inference_ranks(cfg)
    out = capsys.readouterr().out
    assert (f"does nothing with {idle}" in out) if idle else out == "", out


def test_an_evaluation_push_arriving_mid_batch_is_not_loaded_between_chunks(tmp_path):
    """refresh stops at a push marked for evaluation (an EMA's or a plain one): it is evaluated between batches, never
    loaded into a training batch. At S = 1 tests/inflight_forced.py makes a batch wait mid-way until its step's push,
    here the EMA's evaluation push, is staged (found by review: refresh loading every staged push passed the suite,
    and in a real run the evaluation is then swallowed and the trainer waits until --rollout.timeout-s)."""
    out = tmp_path / "run"
    torchrun("tests/inflight_forced.py", "--output-dir", str(out), "--max-steps", "4", "--rollout.engine", "hf",
             "--rollout.inference-ranks", "1", "--rollout.max-staleness", "1", "--rollout.inflight-updates", "1",
             "--rollout.max-completion-length", "4", "--ema.decay", "0.9", "--eval.use-ema", "--eval.every", "2",
             "--eval.num-prompts", "4", "--rollout.timeout-s", "40", "--log.completions-every", "0",
             "--log.no-progress", timeout=300)
    rows = metrics(str(out))
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4] and all("eval/reward" in rows[s] for s in (0, 2, 4)), rows
    # (step 3's batch waited for version 3, the EMA's push, and rightly did not load it: its mismatch may be NaN)
    assert all(r["async/probe_mismatch"] < 1e-3 and not r["logprob_mismatch/mean_abs"] > 1e-3 for r in rows[1:]), rows

