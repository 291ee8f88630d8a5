"""Every flag is read or refused (flags.READS, walked over grpo.Config live), every built-in task with every built-in
model runs or is refused up front, and documented flags that no other test exercised: each test fails if its flag
were silently ignored."""
import copy
import dataclasses
import functools
import json
import os
import subprocess
import sys

import pytest
import torch
import tyro

from conftest import EARLIER_DEFAULTS, ROOT, each_rank, run

# ---- flags.READS: each flag set where nothing reads it is refused by name; set where it is read, accepted ----

# settings a rule can depend on; the first where a flag is not read shows its refusal, one where it is, its acceptance
MODES = [[], ["--advantage-estimator", "gae"], ["--advantage-estimator", "reinforce_pp", "--loss.beta", "0.1"],
         ["--advantage-estimator", "rloo"], ["--dynamic-sampling"], ["--loss.beta", "0.1"],
         ["--loss.beta", "0.1", "--kl-target", "0.1"], ["--rollout.engine", "hf"], ["--rollout.engine", "vllm"],
         ["--rollout.inference-ranks", "1"], ["--eval.every", "0"], ["--ema.decay", "0.9"], ["--lora.r", "8"],
         ["--lora.adapter", "ADAPTER"], ["--model", "GGUF_DIR"], ["--ptx.dataset", "find_digit"], ["--wandb.mode", "offline"],
         ["--resume", "auto"], ["--dataset", "DATA.jsonl"], ["--distill.teacher", "MODEL"],
         ["--model", "builtin:tiny-tools", "--data.tools", "tasks:multiply"],
         ["--model", "builtin:tiny-tools", "--env", "tools_for_tests:make_counting_env"],
         ["--env", "openenv:http://127.0.0.1:9"], ["--env", "verifiers:tests/vf_turns.py"],
         *[["--data.rewards", r] for r in ("overlong", "rm:RM", "http://127.0.0.1:9/score")],
         ["--loss.sampler-correction", "none"], *[["--loss.loss-type", t] for t in __import__("losses").LOSSES]]
# a value away from the default where other_value's (a bool flipped, a number doubled or halved) is not valid
VALUES = {"dataset": "max_digit", "scale_rewards": "none", "reward_aggregation": "normalize_then_sum",
          "kl_target": 0.05, "policy.gguf_file": "m.gguf", "lora.target_modules": ("q_proj",), "vllm.block_size": 16,
          "vllm.tp": 2, "vllm.sleep_level": 2, "rollout.max_total_length": 512,
          "loss.importance_sampling_level": "sequence",
          "loss.epsilon_high": 0.28, "loss.delta": 2.0, "loss.dual_clip": 3.0, "loss.max_completion_length": 8,
          "loss.kl_estimator": "k1", "loss.reward_kl_estimator": "k2", "data.split": "test", "data.eval_split": "test",
          "data.system_prompt": "Be brief.", "data.prompt_column": "question", "data.answer_column": "solution",
          "data.tools": ("tasks:multiply",), "openenv.action_field": "code", "openenv.observation_field": "text",
          "openenv.reward": "sum", "wandb.project": "p", "wandb.name": "n", "checkpoint.allow_changes": ("max_steps",),
          "critic.model": "MODEL", "critic.schedule": "cosine", "ptx.column": "body", "gamma": 0.9, "lam": 0.5,
          "kl_horizon": 100, "dynamic_sampling_max_rounds": 5, "eval.reward": "digit"}
NO_SERVER = ("openenv.",)  # read with --env openenv:URL only, whose check needs a live server (tests/test_hubs.py)


def config_fields(cfg, prefix=""):
    """grpo.Config walked live: {dotted path: default} of every field of every section."""
    out = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        out.update(config_fields(value, f"{prefix}{f.name}.") if dataclasses.is_dataclass(value) else
                   {prefix + f.name: value})
    return out


def rule(path):
    import flags
    return flags.READS[path] if path in flags.READS else flags.READS.get(path.partition(".")[0] + ".*", KeyError)


def other_value(path, default):
    if path in VALUES:
        return VALUES[path]
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):  # (an int doubled, a float halved: each stays in its range)
        return (default * 2 if isinstance(default, int) else default / 2) if default else 1
    return f"{default}x"


def config(args, tmp, model=None):
    import grpo
    subst = {"MODEL": model, "ADAPTER": str(tmp / "adapter"), "DATA.jsonl": str(tmp / "data.jsonl"), "GGUF_DIR": str(tmp)}
    args = [subst.get(a, a.replace("rm:RM", f"rm:{tmp / 'rm'}")) for a in args]
    return tyro.cli(grpo.Config, args=["--output-dir", str(tmp / "out"), *args])


@pytest.fixture(scope="module")
def modes(tmp_path_factory, text_dir):
    """MODES parsed once: [(args, grpo.Config)]."""
    tmp = tmp_path_factory.mktemp("modes")
    (tmp / "m.gguf").write_bytes(b"")  # (a folder holding VALUES' --policy.gguf-file: only its existence is checked)
    (tmp / "rm").mkdir()  # a reward model's config (validate reads no weights)
    (tmp / "rm" / "config.json").write_text(json.dumps({"model_type": "qwen2", "num_labels": 1,
                                                         "architectures": ["Qwen2ForSequenceClassification"]}))
    return [(m, config(m, tmp, text_dir)) for m in MODES]


def with_flag(cfg, path, value, model):
    cfg = copy.deepcopy(cfg)
    *sections, name = path.split(".")
    setattr(functools.reduce(getattr, sections, cfg), name, model if value == "MODEL" else value)
    return cfg


ROWS = [{"prompt": "q 7 k =", "answer": "7"}]


def test_every_flag_has_a_rule():
    """Every field of every section of grpo.Config has a rule in flags.READS (its own or its section's); every key
    of READS is a field or a section; a rule held elsewhere names a function that exists."""
    import grpo
    import flags
    fields = config_fields(grpo.Config())
    assert not [p for p in fields if rule(p) is KeyError], [p for p in fields if rule(p) is KeyError]
    sections = {p.partition(".")[0] + ".*" for p in fields if "." in p}
    assert not [k for k in flags.READS if k not in fields and k not in sections]
    for path in fields:
        if isinstance(rule(path), str):
            module, _, name = rule(path).rpartition(".")
            assert callable(getattr(__import__(module or "flags"), name)), path


@pytest.mark.parametrize("path", [p for p in config_fields(__import__("grpo").Config()) if isinstance(rule(p), tuple)])
def test_a_flag_is_refused_where_it_is_not_read_and_accepted_where_it_is(path, modes, text_dir, monkeypatch):
    """For every flag with a condition: set (away from its default) in the first setting of MODES where its rule says
    it is not read, flags.validate refuses it by name; in a setting where it is read, some setting accepts it."""
    import flags
    import grpo
    monkeypatch.setenv("WORLD_SIZE", "2")  # (room for --rollout.inference-ranks 1)
    value = other_value(path, config_fields(grpo.Config())[path])
    when = rule(path)[0]
    modes = [(m, with_flag(c, path, value, text_dir)) for m, c in modes]
    unread = next(((m, c) for m, c in modes if not when(c)), None)
    assert unread, f"{path}: no setting in MODES where it is not read: add one"
    with pytest.raises(ValueError) as e:
        flags.validate(unread[1], ROWS)
    named = ("--" + path.replace("_", "-"), "--" + path.partition(".")[0] + ".*")
    assert any(n in str(e.value) for n in named), (path, unread[0], str(e.value))
    if path.startswith(NO_SERVER):
        return
    errors = []
    for m, c in modes:
        if when(c):
            try:
                return flags.validate(c, ROWS)
            except (ValueError, FileNotFoundError) as err:
                errors.append((m, str(err)))
    raise AssertionError(f"{path}={value!r}: refused in every setting that reads it: {errors}")


ISSUE = {("--gamma", "0.9"): "--gamma 0.9 is read by --advantage-estimator gae and reinforce_pp only (their returns' "
                             "discount), so it would be ignored. Drop it, or turn on what reads it.",
         ("--lam", "0.5"): "--lam 0.5 is GAE's lambda: only --advantage-estimator gae reads it, so it would be "
                           "ignored. Drop it, or turn on what reads it.",
         ("--kl-horizon", "100"): "--kl-horizon 100 is the adaptive KL's horizon: only --kl-target reads it, so it "
                                  "would be ignored. Drop it, or turn on what reads it.",
         ("--dynamic-sampling-max-rounds", "5"): "--dynamic-sampling-max-rounds 5 bounds the rounds of "
                                                 "--dynamic-sampling only, so it would be ignored. Drop it, or turn on "
                                                 "what reads it.",
         ("--critic.lr", "1e-5"): "--critic.*: only --advantage-estimator gae trains a critic, so it would be ignored "
                                  "(--critic.lr 1e-05). Drop it, or turn on what reads it."}


@pytest.mark.parametrize("args", list(ISSUE), ids=" ".join)
def test_the_flags_the_issue_named_are_refused_with_their_message(args, tmp_path):
    """The five flags that ran and exited 0 with the default settings, with the issue's values (--critic.lr 1e-5 is
    gae's default value, so the field's default is None: a value typed where no critic trains is seen)."""
    import flags
    import grpo
    with pytest.raises(ValueError) as e:
        flags.validate(config(list(args), tmp_path), ROWS)
    assert str(e.value) == ISSUE[args]


# ---- Built-in tasks x built-in models: each pair runs, or is refused in one line before any engine starts ----

@pytest.mark.parametrize("model", list(__import__("flags").BUILTIN_MODELS))
@pytest.mark.parametrize("task", list(__import__("tasks").BUILTIN_TASKS))
def test_every_builtin_task_with_every_builtin_model_runs_or_is_refused(task, model, tmp_path, tool_model):
    """flags.validate on the pair's rows: a refusal is one line naming the model; an accepted pair's train and eval
    prompts encode as grpo.py's sample_prompts and eval_rollouts encode them (the chat template, the tools)."""
    import episodes
    import flags
    import flags
    import grpo
    import launch
    from transformers import AutoTokenizer
    cfg = config(["--model", model, "--dataset", task, "--data.size", "16", "--eval.num-prompts", "4"], tmp_path)
    rows, eval_rows = launch.load_rows(cfg)
    try:
        flags.validate(cfg, rows)
    except ValueError as e:
        assert "\n" not in str(e) and model in str(e), str(e)
        assert not flags.BUILTIN_MODELS[model], f"{model} has a chat template: {task} must run with it"
        return
    path = tool_model if model == "builtin:tiny-tools" else launch.model_path_for(cfg)
    tok = AutoTokenizer.from_pretrained(path)
    tools = list(episodes.load_tools(flags.tool_names(cfg)).values()) or None
    for r in rows[:4] + eval_rows[:4]:
        enc = grpo.encode_prompt(r, tok, cfg.rollout.max_prompt_length, cfg.data.chat_template, cfg.data.system_prompt,
                                 tools)
        assert enc["prompt_ids"] and tok.unk_token_id not in enc["prompt_ids"], (task, model, enc["text"])


def test_a_refused_pair_stops_every_rank_with_one_line(tmp_path):
    """The issue's case: --dataset arith with builtin:tiny on a trainer and an inference rank: both exit 2 with the
    refusal (rank 0 prints it), no traceback, no lost peer."""
    args = ["grpo.py", "--dataset", "arith", "--rollout.inference-ranks", "1", "--output-dir", str(tmp_path / "o")]
    for rank, (code, log, _) in enumerate(each_rank(*args)):
        assert code == 2 and "Traceback" not in log, (rank, log[-2000:])
        assert log.count("--dataset 'arith' has chat-message prompts") == (rank == 0), (rank, log[-2000:])


PROBES = r"""
import json, math, sys, traceback
import transformers.modeling_utils as modeling_utils
import tyro
import grpo
calls, real_checkpoint, real_loss = [0], modeling_utils.checkpoint, grpo.losses.policy_loss
def checkpoint(*args, **kw):  # counts the layers run under transformers' activation checkpoint
    calls[0] += 1
    return real_checkpoint(*args, **kw)
def nan_loss(*args, **kw):  # every policy loss NaN, as a diverged run's would be
    loss, metrics = real_loss(*args, **kw)
    return loss * math.nan, metrics
modeling_utils.checkpoint = checkpoint  # read when gradient_checkpointing_enable builds the layers' function
for name, args in json.loads(sys.argv[1]):  # one run after another in this process (one start-up for all)
    calls[0], code = 0, 0
    grpo.losses.policy_loss = nan_loss if name == "nan_loss" else real_loss
    print(f"PROBE-START {name}", flush=True)
    try:
        grpo.main(tyro.cli(grpo.Config, args=args))
    except Exception:
        traceback.print_exc(file=sys.stdout)  # (in this run's part of the log)
        code = 1
    print(f"PROBE-END {name} {code} {calls[0]}", flush=True)
"""


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    """grpo.main run in one process, HF engine, batch 16, three times: without and with --policy.gradient-checkpointing
    (1 step each: the plain run first, so nothing of the flagged one's can leak into it), then with every loss NaN and
    --max-bad-steps 2 (last: its stop leaves the process group up). -> {name: (exit code, log, probe count), out dirs}"""
    tmp = tmp_path_factory.mktemp("probes")
    defaults = [x for flag, value in EARLIER_DEFAULTS.items() for x in (flag, value)]
    runs = [("off", ["--max-steps", "1"]), ("on", ["--max-steps", "1", "--policy.gradient-checkpointing"]),
            ("nan_loss", ["--max-steps", "10", "--max-bad-steps", "2"])]
    _, log, _ = run([sys.executable, "-c", PROBES, json.dumps([
        (name, ["--output-dir", str(tmp / name), "--rollout.engine", "hf", "--log.completions-every", "0",
                "--batch-size", "16", *flags, *defaults]) for name, flags in runs])], timeout=600)
    got = {}
    for name, _ in runs:
        part = log.split(f"PROBE-START {name}\n", 1)[1].split(f"PROBE-END {name} ", 1)
        code, count = part[1].split()[:2]
        got[name] = (int(code), part[0], int(count))
    return got, tmp


def test_gradient_checkpointing_runs_the_layers_under_checkpoint(probes):
    """--policy.gradient-checkpointing: the training forward runs each decoder layer under activation checkpointing
    (2 layers x 1 micro-batch per update); without the flag, never."""
    got, _ = probes
    assert got["off"][0] == 0 and got["on"][0] == 0, (got["off"][1][-3000:], got["on"][1][-3000:])
    on, off = got["on"][2], got["off"][2]
    assert on >= 2 and off == 0, (on, off)


def test_max_bad_steps_writes_a_checkpoint_and_stops(probes):
    """--max-bad-steps 2 with a loss that is always NaN: both updates skipped, checkpoint-2 written, the run stops with
    the message (the default, 3, would write checkpoint-3)."""
    (code, log, _), out = probes[0]["nan_loss"], probes[1] / "nan_loss"
    assert code != 0 and "2 consecutive steps had a NaN/Inf loss or gradient norm (--max-bad-steps 2)" in log, log[-3000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2] and all(r["skipped_updates"] == 1 for r in rows)
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-2"]


def test_overlong_cache_sets_the_penalty_ramp():
    """--data.overlong-cache reaches DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13), written out here:
    0 up to L_max - L_cache tokens, then linear down to -1 at L_max."""
    import scoring
    import tasks
    L, cache = 10, 3
    fn = scoring.resolve_reward("overlong", tasks.DataConfig(overlong_cache=cache), max_completion_length=L)
    lens = list(range(L + 1))
    expected = [0.0 if n <= L - cache else (L - cache - n) / cache for n in lens]
    assert fn([""] * len(lens), [""] * len(lens), completion_ids=[[1] * n for n in lens]) == pytest.approx(expected)


def test_lora_dropout_reaches_the_adapters(text_dir):
    """--lora.dropout: every adapter's dropout has that rate, so once the adapters are non-zero two training forwards
    differ and two eval forwards do not."""
    import models
    model, _ = models.load_policy(text_dir, lora=models.LoraConfig(r=8, dropout=0.3))
    drops = [m for n, m in model.named_modules() if n.endswith("lora_dropout.default")]
    assert drops and all(isinstance(m, torch.nn.Dropout) and m.p == 0.3 for m in drops)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        model.train()
        a, b = model(input_ids=ids).logits, model(input_ids=ids).logits
        model.eval()
        c, d = model(input_ids=ids).logits, model(input_ids=ids).logits
    assert not torch.equal(a, b) and torch.equal(c, d)


ENGINE_PROBE = r"""
import json, sys, torch
import models, rollout, weight_sync
path, kv_gb = sys.argv[1], float(sys.argv[2])
engine = rollout.VLLMEngine(path, seed=0, cfg=rollout.VLLMConfig(max_model_len=256, kv_cache_gb=kv_gb,
                            sync_bucket_mb=0), dtype="float32", show_progress=False)
cache = engine.llm.llm_engine.vllm_config.cache_config
calls, real = [0], engine.llm.collective_rpc
def counted(method, *a, **kw):
    calls[0] += method == "reload_weights"
    return real(method, *a, **kw)
engine.llm.collective_rpc = counted
model, _ = models.load_policy(path)
reloads = {}
for bucket_mb in (0, rollout.VLLMConfig.sync_bucket_mb):  # 0 as the engine was built from it, then the default set
    if bucket_mb:  # on the same engine (one engine per process)
        engine.bucket_mb = bucket_mb
    calls[0] = 0
    engine.load_weights(weight_sync.iter_engine_weights(model, torch.float32))
    reloads[bucket_mb] = calls[0]
print("PROBE " + json.dumps({"kv_bytes": cache.kv_cache_memory_bytes, "reloads": reloads,
                             "layers": model.config.num_hidden_layers}))
"""


def test_vllm_kv_cache_and_sync_bucket_flags_reach_the_engine(text_dir):
    """--vllm.kv-cache-gb is the engine's KV-cache budget on CPU (when VLLM_CPU_KVCACHE_SPACE is not set); --vllm.sync-bucket-mb
    sizes the weight sync's reload calls: 0 MB sends one decoder layer per call (at least one call per layer), the
    default 1024 MB all of this tiny model in one."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}  # set, it overrides the flag
    out = subprocess.run([sys.executable, "-c", ENGINE_PROBE, text_dir, "0.25"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    got = json.loads(out.split("PROBE ", 1)[1].splitlines()[0])
    assert got["kv_bytes"] == 2**28
    assert got["reloads"]["0"] >= got["layers"] and got["reloads"]["1024"] == 1, got


def test_mask_truncated_completions_leaves_them_out_of_the_loss(tmp_path):
    """--rollout.mask-truncated-completions (DAPO's overlong filtering): the loss mask of every completion cut at
    --rollout.max-completion-length is all zero, the others' is their tokens (3 tokens: the tiny policy rarely stops
    that early, so most of the 16 are cut)."""
    out = tmp_path / "mask"
    run([sys.executable, "tests/episode_dump.py", "--output-dir", str(out), "--max-steps", "1", "--rollout.engine", "hf",
         "--rollout.max-completion-length", "3", "--rollout.mask-truncated-completions", "--batch-size", "16",
         "--micro-batch-size", "16", "--policy.no-share-prompts", "--log.completions-every", "0"], timeout=300)
    rec = torch.load(out / "dump.pt", weights_only=False)
    samples = rec["samples"][0]
    assert any(s["truncated"] for s in samples)
    assert sorted(i for f in rec["forward"] for i in f["rows"]) == list(range(16))  # every row, in some micro-batch
    for fwd, loss in zip(rec["forward"], rec["loss"]):
        for k, i in enumerate(fwd["rows"]):
            n = len(samples[i]["completion_ids"])
            expected = [0.0 if samples[i]["truncated"] else 1.0] * n
            assert loss["mask"][k, :n].tolist() == expected and not loss["mask"][k, n:].any(), (i, loss["mask"][k])
