"""inference_ranks.py: asynchronous rollouts on dedicated inference ranks, inside one plain torchrun job.

--rollout.inference-ranks K: the last K ranks of the world only generate; the others only train. Each side gets its
own default process group, and two more groups cross the split: `weights` (trainer 0 + every generator: versioned
weight broadcasts) and `bridge` (every rank, gloo: finished batches, point to point). Versions and staleness, the
staging thread, evaluations, the stop marker, timeouts and the probe check: docs/async.md."""
import dataclasses
import functools
import itertools
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

import batching
import distributed
import dynamic_sampling
import inflight
import optim
import probe
import rollout
import weight_sync
from console import UserError
from messages import decode, encode


@dataclass
class Link:
    """This rank's place in the split world and the two groups that cross it (raw backends, not registered)."""
    role: str  # trainer | generator
    world_rank: int
    world: int
    n_trainers: int
    tp: int  # generators per engine (vLLM TP group)
    timeout: timedelta
    bridge: object  # every rank (gloo): batches
    weights: object | None  # trainer 0 + generators (weights-group rank 0 = trainer 0)
    device: torch.device  # where the weights group's tensors live (cuda for NCCL)
    sends: list = field(default_factory=list)  # per posted batch: [(work, buffer, dst)], buffers alive until done
    version: int = -1  # last version pushed (trainers) or applied (generator)
    probes: dict = field(default_factory=dict)  # trainers: {version: probe log-probs [T] float64}, recent versions
    probed: dict = field(default_factory=dict)  # generator: {version: its engine's probe log-probs}, the batch's
    sigterm: bool = False  # generator: preemption; it keeps serving until the trainers' stop marker
    store: object = None  # torchrun's store: the first rank to find a peer lost says so, the others stay quiet
    cp: int = 1  # trainer ranks per data-parallel trainer (--policy.context-parallel): a group takes one batch

    @property
    def n_engines(self):
        return (self.world - self.n_trainers) // self.tp

    @property
    def n_data(self):  # the data-parallel trainers the step's prompts are cut for
        return self.n_trainers // self.cp


def connect(k, tp, timeout_s, cp=1):
    """Split torchrun's world: the first world-k ranks train, the last k generate. Initialises this side's default
    process group (torch.distributed calls in every other module then see only their own side) and the two groups
    that cross. RANK / WORLD_SIZE are rewritten to the side's values (vLLM's external launcher reads them)."""
    store, rank, world = next(dist.rendezvous("env://"))
    n_train, cuda = world - k, torch.cuda.is_available()
    role = "trainer" if rank < n_train else "generator"
    side_rank, side_world = (rank, n_train) if role == "trainer" else (rank - n_train, k)
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.PrefixStore(role, store), rank=side_rank,
                            world_size=side_world)
    os.environ.update(RANK=str(side_rank), WORLD_SIZE=str(side_world), GLOBAL_RANK=str(rank))
    if role == "generator":  # their reductions (dynamic sampling, scoring) run while the staging thread receives
        distributed.CONTROL_GROUP = dist.new_group(backend="gloo")
    bridge = dist.ProcessGroupGloo(dist.PrefixStore("bridge", store), rank, world, timeout)
    weights, members = None, [0] + list(range(n_train, world))
    if rank in members:
        args = (dist.PrefixStore("weights", store), members.index(rank), len(members))
        if cuda:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            weights = dist.ProcessGroupNCCL(*args, opts)
        else:
            weights = dist.ProcessGroupGloo(*args, timeout)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return Link(role, rank, world, n_train, tp, timeout, bridge, weights, device, store=store, cp=cp)


# ---- Waits that time out with a name: every cross-side operation goes through these ----

def _wait(work, link, what):
    """Wait for a posted collective, or a function that posts it (a peer that died first fails the post itself)."""
    try:
        work = work() if callable(work) else work
        if link.device.type == "cuda":  # NCCL's wait() does not block the host: poll against the deadline
            deadline = time.time() + link.timeout.total_seconds()
            while not work.is_completed():
                if time.time() > deadline:
                    raise TimeoutError("no completion before the deadline")
                time.sleep(1e-3)
        work.wait(link.timeout)
    except Exception as e:  # gloo: a closed connection at once when the peer died, a timeout when it hangs
        lost = RuntimeError(f"rank {link.world_rank} ({link.role}): {what}: no answer. That rank died or hangs (waits "
                            f"across the split time out after --rollout.timeout-s {link.timeout.total_seconds():.0f}); "
                            f"stopping. ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
        lost.first = lambda: link.store is None or link.store.add("peer_lost", 1) == 1  # console.run_script: this
        raise lost from None  # line, no traceback, from the first rank to report a lost peer (a count in the store)


def broadcast_object(link, obj, root, what, group=None):
    """(the weights group, or `group`) The root's object (see encode) on every member."""
    group = link.weights if group is None else group
    mine = group.rank() == root
    payload = encode(obj).to(link.device) if mine else None
    size = torch.tensor([payload.numel() if mine else 0], dtype=torch.int64, device=link.device)
    _wait(lambda: group.broadcast(size, root), link, what)
    payload = payload if mine else torch.empty(int(size.item()), dtype=torch.uint8, device=link.device)
    _wait(lambda: group.broadcast(payload, root), link, what)
    return obj if mine else decode(payload)


def send_object(link, obj, trainer, tag, table=()):
    """(bridge) Post sends to data-parallel trainer `trainer`, each rank of its context-parallel group the same object,
    into the newest entry of link.sends and return at once; finish_sends() waits for them."""
    payload = encode(obj, table)
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    for dst in range(trainer * link.cp, (trainer + 1) * link.cp):
        link.sends[-1] += [(link.bridge.send([size], dst, 2 * tag), size, dst),
                           (link.bridge.send([payload], dst, 2 * tag + 1), payload, dst)]


def finish_sends(link, keep=0):
    """Wait until at most `keep` posted batches remain in flight (a gloo send completes when the trainer takes it)."""
    while len(link.sends) > keep:
        for work, _, dst in link.sends.pop(0):
            _wait(work, link, f"sending a batch to trainer rank {dst}")


def recv_object(link, src, tag, what, table=()):
    size = torch.zeros(1, dtype=torch.int64)
    _wait(lambda: link.bridge.recv([size], src, 2 * tag), link, what)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    _wait(lambda: link.bridge.recv([payload], src, 2 * tag + 1), link, what)
    return decode(payload, table)


# ---- Which prompts each engine generates: the step's prompts in trainer-rank order, cut into one slice per engine ----

def engine_slices(n_trainers, per_trainer, n_engines):
    """-> {engine: [(trainer, first prompt, end)]}: engine e takes the e-th contiguous share of the step's
    n_trainers x per_trainer prompts (whole prompts, so a group of G never spans engines)."""
    total = n_trainers * per_trainer
    share = -(-total // n_engines)
    spans = [(e * share, min(total, (e + 1) * share)) for e in range(n_engines)]  # [lo, hi) of the step's prompts
    return {e: [(t, max(lo, t * per_trainer) - t * per_trainer, min(hi, (t + 1) * per_trainer) - t * per_trainer)
                for t in range(n_trainers) if lo < (t + 1) * per_trainer and hi > t * per_trainer]
            for e, (lo, hi) in enumerate(spans)}


def per_trainer(cfg):
    """Prompts per training rank per step (grpo.sample_prompts' share; a vLLM TP group holds tp of them)."""
    return cfg.batch_size * cfg.steps_per_generation // cfg.num_generations


def generators(link):
    first, last = link.n_trainers, link.world - 1
    return f"inference rank {first}" if first == last else f"inference ranks {first}-{last} (one of them)"


EVAL_TAG = 1 << 24  # bridge tags: batches use the step, evaluations this + the version


def engine_leader(link, e):
    return link.n_trainers + e * link.tp


# ---- Trainer side ----

def push_weights(run, version, evaluate=False, ema_params=None):
    """(trainers) Push the policy as `version` (unless already pushed), tagged with whether to evaluate it; with
    ema_params (--eval.use-ema: the trainable (name, parameter) pairs) its EMA first, tagged "ema": the generators
    evaluate that, then load the live weights that follow. Then the trainers score the probe. -> (seconds, bytes)."""
    link, starts, tally = run.link, [], {"bytes": 0}
    if link.version == version:
        return 0.0, 0
    for flag, ema in ([("ema", run.ema)] if ema_params else []) + [(evaluate and not ema_params, None)]:
        with optim.ema_weights(ema, ema_params or []):
            starts.append(_send_version(run, {"version": version, "eval": flag}, link.version < 0 and not starts, tally))
    link.version, seconds = version, time.time() - starts[0]
    oldest = version - run.cfg.rollout.max_staleness - 1  # a batch's version is >= its step - S
    link.probes = {v: p for v, p in link.probes.items() if v >= oldest} | {version: probe.trainer_probe(run)}
    return seconds, tally["bytes"]


def _send_version(run, header, first, tally):
    """Gather the policy one layer bucket at a time (a collective among trainers); trainer 0 broadcasts the header and
    the buckets to every generator. The first push names every tensor, and the generators' engines check the names
    before any weight moves (raises on every rank alike). -> when the transfer began (after the header's wait)."""
    adapter = run.cfg.lora.sync == "adapter"
    link, header["names"] = run.link, weight_sync.sync_names(run.policy, adapter) if first else None
    header["ds_extra_rounds"] = run.ds_extra_rounds  # (read from the first push: a resumed run's prompts go on there)
    if run.rank == 0:
        broadcast_object(link, header, 0, f"pushing weights to {generators(link)}")
    if first:  # the generators' answer, to every trainer: all raise together
        unknown = broadcast_object(link, None, 1, f"the name check of {generators(link)}") if run.rank == 0 else None
        weight_sync.raise_unknown_names(broadcast_object(link, unknown, 0, "the name check", dist.group.WORLD))
    t0 = time.time()
    weights = weight_sync.engine_weights(run.policy, run.precision["sync"], full=first, adapter=adapter, tally=tally)
    for bucket in weight_sync.layer_buckets(weights, run.cfg.vllm.sync_bucket_mb * 2**20):
        if run.rank == 0:
            broadcast_object(link, {"names": [n for n, _ in bucket], "shapes": [tuple(t.shape) for _, t in bucket],
                                    "dtype": bucket[0][1].dtype}, 0, f"pushing weights to {generators(link)}")
            flat = torch.cat([t.reshape(-1).to(link.device) for _, t in bucket])
            _wait(lambda: link.weights.broadcast(flat, 0), link, f"pushing weights to {generators(link)}")
    if run.rank == 0:
        broadcast_object(link, None, 0, f"pushing weights to {generators(link)}")  # end of this version
    return t0


def stop_generators(run):
    """(trainers, at the end or a safe stop) The stop marker, then close this trainer's ends of the crossing groups."""
    if run.rank == 0:
        broadcast_object(run.link, {"version": None, "stop": True}, 0, f"stopping {generators(run.link)}")
    dist.barrier()  # no trainer closes its end before the marker is out (a closed end fails the generators' sends)
    close(run.link)


def evaluation_outputs(run, version, ema_params=None):
    """(trainers) Push `version` (or its EMA: push_weights) for evaluation; this trainer's engine generates its share
    of the held-out prompts (eval_rows[trainer::n_data], as colocated) -> (rows, [[completion dict]], bytes)."""
    sent = push_weights(run, version, evaluate=True, ema_params=ema_params)[1]
    src = engine_leader(run.link, run.dp_rank % run.link.n_engines)
    msg = recv_object(run.link, src, EVAL_TAG + version, f"waiting for the evaluation of version {version} from "
                      f"inference rank {src}", run.rows + run.eval_rows)
    return msg["rows"], msg["outs"], sent


def receive_batch(run, step):
    """(trainers) This trainer's samples of `step` from the engines that generated them, each sample tagged with its
    staleness (step - version) -> (samples, metrics). Collective among trainers (global staleness, waits and the
    probe check: every engine of a step holds the same version)."""
    link, t0, samples, gen_wait, (gap, worst), scored = run.link, time.time(), [], 0.0, (0.0, -1), {}
    for e, parts in engine_slices(link.n_data, per_trainer(run.cfg), link.n_engines).items():
        if any(t == run.dp_rank for t, _, _ in parts):
            src = engine_leader(link, e)
            msg = recv_object(link, src, step, f"waiting for the batch of step {step + 1} from inference rank {src}",
                              run.rows + run.eval_rows)
            if "error" in msg:  # the generator stopped on bad input (forward_error): the trainers say it
                raise UserError(f"inference rank {src}: {msg['error']}")
            if msg["step"] != step:
                raise RuntimeError(f"inference rank {src} sent step {msg['step'] + 1} for step {step + 1}")
            samples += [{**s, "staleness": step - min([v for v in s.get("engine_versions", ()) if v >= 0]
                                                      or [msg["version"]])} for s in msg["samples"]]
            gen_wait, (gap, worst) = max(gen_wait, msg["wait_s"]), max((gap, worst), probe.probe_gap(link, msg))
            scored = {"counts": msg["counts"], **msg["dynamic_sampling"],  # the same in each, but the time: the slowest
                      "time/dynamic_sampling": max(scored.get("time/dynamic_sampling", 0.0),
                                                   msg["dynamic_sampling"]["time/dynamic_sampling"])} if "counts" in msg else {}
    samples = dynamic_sampling.colocated_order(samples, run.cfg.num_generations) if scored else samples
    wait = time.time() - t0
    stale = [s["staleness"] for s in samples]
    n = distributed.global_sums({"stale": sum(stale), "samples": len(stale)}, run.device)
    peak = distributed.global_sums({"async/staleness_max": max(stale), "async/generator_wait_s": gen_wait,
                                    "async/trainer_wait_s": wait, "async/probe_mismatch": gap}, run.device,
                                   dist.ReduceOp.MAX)
    probe.check_probe(run, worst, peak["async/probe_mismatch"])  # before anything trains on the batch
    if run.cfg.rollout.inflight_updates:  # over every trainer's samples
        spread, partial = inflight.version_spread(samples)
        peak["async/version_spread_max"] = distributed.global_sums({"s": spread}, run.device, dist.ReduceOp.MAX)["s"]
        peak["async/partial_frac"] = distributed.global_sums({"p": partial}, run.device)["p"] / n["samples"]
    return samples, {"async/staleness_mean": n["stale"] / n["samples"], **peak, **scored}


# ---- Generator side ----

def receive_header(link, engine=None):
    """(generators) The next push's header: {version, eval, names} or {stop}. The first push names every tensor:
    `engine` checks them and every generator answers trainer 0 before any weight moves (all raise alike)."""
    header = broadcast_object(link, None, 0, "waiting for weights from trainer rank 0")
    if header.get("names") is not None:
        unknown = engine.unknown_names(header["names"])
        broadcast_object(link, unknown, 1, "answering trainer rank 0's name check")
        weight_sync.raise_unknown_names(unknown)
    return header


def received_tensors(link):
    """(generators) Yield the pushed (name, tensor) pairs bucket by bucket, as they arrive."""
    while (meta := broadcast_object(link, None, 0, "receiving weights from trainer rank 0")) is not None:
        numel = [int(torch.Size(s).numel()) for s in meta["shapes"]]
        flat = torch.empty(sum(numel), dtype=meta["dtype"], device=link.device)
        _wait(lambda: link.weights.broadcast(flat, 0), link, "receiving weights from trainer rank 0")
        yield from zip(meta["names"], (p.view(s) for p, s in zip(flat.split(numel), meta["shapes"])))


def pump(link, staged, cond):
    """(generators) Receive one push into `staged` (host memory: [(version, tensors, its eval flag)]) or its stop."""
    header = receive_header(link)
    tensors = {} if header.get("stop") else {n: t.cpu() for n, t in received_tensors(link)}
    with cond:
        staged["stop"] = bool(header.get("stop"))
        staged["versions"] += [] if staged["stop"] else [(header["version"], tensors, header["eval"])]
        cond.notify_all()


def stage_versions(link, staged, cond):
    """(generator thread, CPU) Receive every push as it arrives, until the stop marker."""
    try:
        while not staged["stop"]:
            pump(link, staged, cond)
    except BaseException as e:  # handed to the main thread, which raises it
        with cond:
            staged["error"] = e
            cond.notify_all()


def raise_staged_error(link, staged):
    """The staging thread's failure (a dead trainer, a timeout), raised on the generator's main thread; a lost peer
    (_wait's) as it is: console.run_script prints its line naming trainer rank 0."""
    if (e := staged["error"]) is not None:
        raise (e if hasattr(e, "first") else RuntimeError(f"rank {link.world_rank} (generator): waiting for weights "
                                                          f"from trainer rank 0 failed: {e}")) from None


def apply_version(run, staged, cond, needed):
    """Wait until this generator holds a version >= needed, agree with the other generators on the newest version
    all of them hold (one engine's TP ranks must load the same), load it -> (version, seconds waited, eval flag), or
    None after the stop marker. (An evaluation's version is the newest: the trainers wait for its results before
    pushing more; an EMA is loaded alone and leaves link.version as it was: its live twin comes next.)"""
    link, t0 = run.link, time.time()
    held = lambda: staged["versions"][-1][0] if staged["versions"] else link.version  # noqa: E731
    if not staged["thread"]:  # CUDA: receive on this thread, between batches
        while held() < needed and not staged["stop"]:
            pump(link, staged, cond)
    with cond:
        while staged["error"] is None and held() < needed and not staged["stop"]:
            if not cond.wait(timeout=max(0.0, link.timeout.total_seconds() - (time.time() - t0))):
                staged["error"] = TimeoutError(f"no weights of version {needed} within {link.timeout}")
        raise_staged_error(link, staged)
        if held() < needed:  # stopped
            return None
        newest = held()
    # (in flight: one generator per engine, nothing to agree on, and no collective beside the staging thread's)
    version = newest if run.cfg.rollout.inflight_updates else int(
        distributed.global_sums({"newest": newest}, run.device, dist.ReduceOp.MIN)["newest"])
    waited = time.time() - t0
    with cond:  # the pushes up to `version` (a prefix), cut after an EMA
        todo = list(itertools.takewhile(lambda x: x[0] <= version, staged["versions"]))
        todo = todo[:next((i + 1 for i, x in enumerate(todo) if x[2] == "ema"), len(todo))]
        del staged["versions"][:len(todo)]
    if not todo:
        return link.version, waited, False
    load_staged(run, todo)
    return todo[-1][0], waited, todo[-1][2]


def load_staged(run, todo):
    """Load staged pushes [(version, tensors, eval flag)] into the engine, the newest tensor of each name winning."""
    run.engine.load_weights(iter({n: t for _, tensors, _ in todo for n, t in tensors.items()}.items()))
    if todo[-1][2] != "ema":
        run.link.version = todo[-1][0]
        run.link.probed[run.link.version] = probe.engine_probe(run.engine, run.processor)


def refresh(run, staged, cond):
    """(generator, --rollout.inflight-updates, between decode chunks) Load the staged versions pushed before the next
    evaluation's, without waiting and without a collective (one generator per engine) -> the engine's version."""
    with cond:
        raise_staged_error(run.link, staged)
        todo = list(itertools.takewhile(lambda x: not x[2], staged["versions"]))
        del staged["versions"][:len(todo)]
    if todo:
        load_staged(run, todo)
    return run.link.version


def serve_evaluation(run, version, evaluate):
    """(generators) The held-out prompts of every trainer this engine serves, at `version`; the leader sends each
    trainer its completions. evaluate(version, trainer) is grpo.py's."""
    link = run.link
    link.sends.append([])
    for t in range(link.n_data):
        if t % link.n_engines == run.dp_rank:
            rows = run.eval_rows[t::link.n_data]
            outs = evaluate(version, t)
            if run.rank % run.tp == 0:
                send_object(link, {"rows": rows, "outs": outs}, t, EVAL_TAG + version, run.rows + run.eval_rows)


def engine_samples(run, step, parts, sample_prompts, rollouts, rnd=0):
    """(generators) This engine's share `parts` of step `step`'s prompts (dynamic sampling's round `rnd`: the next
    blocks, seeded as colocated) -> samples, groups contiguous in trainer order."""
    cfg, prompts, seeds = run.cfg, [], []
    for t, lo, hi in parts:
        prompts += sample_prompts(step, t, rnd)[lo:hi]
        seeds += rollout.completion_seeds(cfg.seed, f"{step}.{rnd}" if rnd else step, t * per_trainer(cfg),
                                          per_trainer(cfg), cfg.num_generations)[lo:hi]
    outs = rollouts(prompts, seeds) if prompts else []
    return [{"prompt_ids": p["prompt_ids"], **({"mm": p["mm"]} if "mm" in p else {}), **c}
            for p, o in zip(prompts, outs) for c in o]


def send_batch(run, step, version, waited, sample_prompts, rollouts, score):
    """(generators) This engine's share of step `step`: generate (with --data.tools / --env whole episodes, their tools
    and environment run here; with --dynamic-sampling scored here and refilled, dynamic_sampling.fill_on_generator),
    then the leader posts each trainer its samples (at most --rollout.max-staleness batches in flight)."""
    cfg, link = run.cfg, run.link
    parts = engine_slices(link.n_data, per_trainer(cfg), link.n_engines)[run.dp_rank]
    link.probed = {link.version: link.probed[link.version]}  # and each version loaded between its chunks
    samples, extra = engine_samples(run, step, parts, sample_prompts, rollouts), {}
    sizes = {t: (hi - lo) * cfg.num_generations for t, lo, hi in parts}  # samples per trainer
    if cfg.dynamic_sampling:
        samples, extra, sizes = dynamic_sampling.fill_on_generator(
            run, samples, score, functools.partial(engine_samples, run, step, parts, sample_prompts, rollouts),
            [t for t, lo, hi in parts for _ in range(hi - lo)])
    finish_sends(link, keep=max(cfg.rollout.max_staleness - 1, 0))
    link.sends.append([])
    if run.rank % run.tp:
        return
    k = 0
    for t, _, _ in parts:
        n = sizes.get(t, 0)  # (with --dynamic-sampling an engine may keep none of a trainer's groups, or more)
        send_object(link, {"step": step, "version": version, "wait_s": waited, "samples": samples[k:k + n],
                           "probes": sorted(link.probed.items()), **extra}, t, step, run.rows + run.eval_rows)
        k += n


def forward_error(run, step, error):
    """(generators) A bad-input stop here goes to the trainers that wait for this step's batch: they stop with it, one
    `error:` line on trainer 0; the generator leaves without a message of its own once they took it."""
    link = run.link
    link.sends.append([])
    for t, _, _ in engine_slices(link.n_data, per_trainer(run.cfg), link.n_engines)[run.dp_rank]:
        if run.rank % run.tp == 0:
            send_object(link, {"step": step, "error": str(error)}, t, step)
    finish_sends(link)
    time.sleep(5)  # torchrun ends every worker when one exits: the trainers print first
    raise SystemExit(2)


def serve(run, sample_prompts, rollouts, evaluate, score):
    """(generators) The inference ranks' whole run: load the first version (its names checked), then generate each
    step's share with weights at most --rollout.max-staleness versions old, send it, evaluate what is pushed for it;
    leave at the stop marker. SIGTERM (preemption) does not stop a generator: the trainers may wait for its batch
    before their safe stop. sample_prompts, rollouts, evaluate and score (--dynamic-sampling) are grpo.py's."""
    cfg, link = run.cfg, run.link
    signal.signal(signal.SIGTERM, lambda *_: setattr(link, "sigterm", True))
    chunk = cfg.rollout.inflight_updates  # (one generator per engine: a staging thread has no TP all-reduce to cross)
    staged = {"versions": [], "error": None, "stop": False, "batch": False,
              "thread": link.device.type != "cuda" or chunk > 0}
    cond = threading.Condition()
    if chunk:  # training batches sampled chunk by chunk, newer weights loaded between chunks; evaluations (an EMA's
        whole, load = run.engine.generate, functools.partial(refresh, run, staged, cond)  # too) in one piece
        run.engine.generate = lambda *a, **k: (inflight.generate_in_chunks(whole, load, chunk, *a, **k)
                                               if staged["batch"] else whole(*a, **k))
    try:
        header = receive_header(link, run.engine)
        if header.get("stop"):  # nothing to do (e.g. a resumed run that had already finished)
            return finish(run)
        run.engine.load_weights(received_tensors(link))  # streamed: the first push is not staged
        run.ds_extra_rounds = header["ds_extra_rounds"]  # the trainers' (checkpointed): where the prompts resume
        if header["eval"]:
            serve_evaluation(run, header["version"], evaluate)
        if header["eval"] == "ema":  # that was the EMA's evaluation: the live weights follow at once
            header = receive_header(link)
            run.engine.load_weights(received_tensors(link))
        link.version = start = header["version"]  # the trainers' step (a resumed run starts past 0)
        link.probed = {start: probe.engine_probe(run.engine, run.processor)}
        if staged["thread"]:
            staged["worker"] = threading.Thread(target=stage_versions, args=(link, staged, cond), daemon=True)
            staged["worker"].start()
        for step in itertools.count(start):  # past the last step: a final evaluation, then wait for the stop marker
            got = apply_version(run, staged, cond, step - cfg.rollout.max_staleness if step < cfg.max_steps else step)
            if got and got[2]:
                serve_evaluation(run, got[0], evaluate)
            if got and got[2] == "ema":  # that version's live weights come next: they generate the batch
                got = apply_version(run, staged, cond, got[0])
            if got is None:  # the stop marker
                break
            if step < cfg.max_steps:
                staged["batch"] = True
                try:
                    send_batch(run, step, got[0], got[1], sample_prompts, rollouts, score)
                except UserError as e:  # its rewards all failed (--dynamic-sampling scores here)
                    forward_error(run, step, e)
                staged["batch"] = False
        finish_sends(link)
    except RuntimeError:
        with cond:  # at a safe stop, a send the trainers will never take can fail just before their marker lands
            cond.wait_for(lambda: staged["stop"] or staged["error"] is not None, timeout=10 if "worker" in staged else 0)
        if not (staged["stop"] or link.sigterm):
            raise_staged_error(link, staged)  # the thread's wait names the trainer that left (a send fails bare)
            raise
    return finish(run, staged.get("worker"))


def close(link):
    """(both sides, at the end) Shut the crossing groups down while the interpreter is alive: left to its finalisation,
    gloo's threads can abort a finished process (seen once on CI: 'terminate called without an active exception')."""
    for group in [g for g in (link.weights, link.bridge) if g is not None]:
        group.shutdown()
    link.weights = link.bridge = None


def finish(run, worker=None):
    if worker is None or not worker.is_alive():  # a receive still blocked on a group: leave it to the exit
        close(run.link)
    if not isinstance(run.engine, rollout.VLLMEngine):  # vLLM's exit hook tears its groups and the world down itself
        dist.destroy_process_group()


def trainer_batch(run, step, score):
    """(trainers) grpo.py's stages 1-4: push the policy as version `step`, take this trainer's samples of `step`,
    scored by the generators with --dynamic-sampling, here by score(samples) otherwise -> batching.Scored."""
    t_sync, sync_bytes = push_weights(run, step)
    t_gen = time.time()
    samples, metrics = receive_batch(run, step)
    metrics.update({"time/sync": t_sync, "time/weight_transfer": t_sync, "sync/bytes": sync_bytes,
                    "time/generate": time.time() - t_gen})
    if "counts" in metrics:  # the generators scored (and filled) the batch
        rewards, counts = dynamic_sampling.received(samples, metrics)
        return batching.Scored(samples, rewards, counts, metrics)
    return dataclasses.replace(score(samples), metrics=metrics)
