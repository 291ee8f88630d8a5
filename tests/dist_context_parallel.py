"""torchrun --nproc_per_node 4: TokenLogprobs with each row split over a context-parallel group of 2 and of 4 ranks
(context_parallel.py) gives the per-token log-probs, entropies and parameter gradients of one process running the
whole rows (the reference, computed on every rank alone), float64, on right-padded rows of different lengths (one row
per sample, and completions sharing their prompt's row), and with a LoRA adapter; TokenValues (the critic) gives its
per-token values and gradients.

The gradient: every rank of a group computes the same loss on the gathered log-probs, and the gather's backward sums
their gradients, so the group's gradients summed are N x the reference's (FSDP2 averages over all world ranks, which
are N x the data-parallel ones: the N cancels; grpo.py's loss divides by the data-parallel size)."""
import copy

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForTokenClassification

import context_parallel
import models
from token_logprobs import TokenLogprobs, TokenValues, collate

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
# 3 query heads, 1 KV head (head_dim 8): a head split (Ulysses) could not serve 2 or 4 ranks
config = LlamaConfig(vocab_size=61, hidden_size=24, intermediate_size=48, num_hidden_layers=2, num_attention_heads=3,
                     num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=False)
base = LlamaForCausalLM(config).double().eval()
prompts = [torch.randint(1, 61, (n,)).tolist() for n in (5, 3, 9)]
samples = [{"prompt_ids": prompts[i // 2], "completion_ids": torch.randint(1, 61, (n,)).tolist()}
           for i, n in enumerate((7, 2, 11, 1, 4, 6))]  # [6]: rows of 12, 5, 14, 4, 13, 15 tokens
T = max(len(s["completion_ids"]) for s in samples)
adv = torch.randn(len(samples), dtype=torch.float64)


def run(module, inputs):
    """-> (log-probs [N, T], entropies [N, T], {name: gradient}) of a loss that reads both."""
    module.zero_grad()
    lp, ent = module(inputs, 0.7, with_entropy=True)  # [N, T] each
    mask = inputs["logprob_mask"].double()
    (-((lp * adv[:, None] + 0.1 * ent) * mask).sum() / mask.sum()).backward()
    return lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def run_critic(module, inputs):
    """-> (values [N, T], {name: gradient}) of a squared error against fixed returns."""
    module.zero_grad()
    v = module(inputs)  # [N, T]
    mask = inputs["logprob_mask"].double()
    (((v - adv[:, None]) ** 2 * mask).sum() / mask.sum()).backward()
    return v.detach(), {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def lora(model):
    from peft import LoraConfig, get_peft_model
    targets = models.lora_targets(model)
    wrapped = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    with torch.no_grad():  # lora_B starts at 0: make the adapter matter
        for n, p in wrapped.named_parameters():
            p.add_(0.05 * torch.randn_like(p)) if "lora_B" in n else None
    return wrapped.double()


cases = {"one row per sample": collate(samples, 0, torch.device("cpu"), T),
         "shared prompts": collate(samples, 0, torch.device("cpu"), T, pair_cost=1e9)}
assert cases["shared prompts"]["attention_mask"].dim() == 4  # collate did pack completions with their prompt
torch.manual_seed(1)
lora_model = lora(base)
critic_config = copy.deepcopy(config)
critic_config.num_labels = 1  # a value head
critic = LlamaForTokenClassification(critic_config).double().eval()
for n in (2, 4):
    group = [dist.new_group(list(range(g, g + n))) for g in range(0, world, n)][rank // n]
    for name, model in (("full", base), ("lora", lora_model)):
        for layout, inputs in cases.items():
            ref = run(TokenLogprobs(copy.deepcopy(model)), inputs)  # one process, whole rows
            lp, ent, grads = run(TokenLogprobs(copy.deepcopy(model), cp_group=group), inputs)
            torch.testing.assert_close(lp, ref[0], rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(ent, ref[1], rtol=1e-10, atol=1e-10)
            assert grads.keys() == ref[2].keys() and grads
            for k, g in grads.items():
                dist.all_reduce(g, group=group)  # the group's gradients, summed
                torch.testing.assert_close(g / n, ref[2][k], rtol=1e-9, atol=1e-11, msg=k)
            if rank == 0:
                print(f"N={n} {name} {layout}: log-probs, entropies, {len(grads)} gradients equal", flush=True)
    ref = run_critic(TokenValues(copy.deepcopy(critic)), cases["one row per sample"])
    values, grads = run_critic(TokenValues(copy.deepcopy(critic), cp_group=group), cases["one row per sample"])
    torch.testing.assert_close(values, ref[0], rtol=1e-10, atol=1e-10)
    assert grads.keys() == ref[1].keys() and grads
    for k, g in grads.items():
        dist.all_reduce(g, group=group)  # as the policy's: the group's gradients sum to N x one process's
        torch.testing.assert_close(g / n, ref[1][k], rtol=1e-9, atol=1e-11, msg=k)
    if rank == 0:
        print(f"N={n} critic: values, {len(grads)} gradients equal", flush=True)
    for tp in (1, 2, 4):  # share_rollouts: each engine of the group (tp ranks each, vLLM TP) runs a share, 7 prompts
        ran = []
        got = context_parallel.share_rollouts(group, list(range(7)), [[10 + i] for i in range(7)],
                                              lambda p, s: ran.append(p) or [[(i, j[0])] for i, j in zip(p, s)], tp)
        assert got == [[(i, 10 + i)] for i in range(7)], (n, tp, got)  # every prompt once, in order, with its seeds
        every = [None] * world
        dist.all_gather_object(every, ran)
        engines = {}  # the prompts each engine ran: its ranks alike (an engine's TP ranks take the same inputs)
        for r, mine in enumerate(every):
            assert engines.setdefault(r // tp, mine) == mine, (n, tp, every)
        e, k = rank % n // tp, -(-7 // max(n // tp, 1))  # this rank's engine in the group, a share's size
        assert ran == [list(range(7))[e * k:(e + 1) * k]], (n, tp, ran)  # within one engine (tp >= n): all 7
    if rank == 0:
        print(f"N={n} share_rollouts: every engine one share, each prompt once", flush=True)
print(f"rank {rank} CONTEXT PARALLEL OK", flush=True)
dist.destroy_process_group()
