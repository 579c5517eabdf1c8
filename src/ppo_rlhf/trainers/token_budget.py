"""How many tokens one micro-batch of the rollout's passes and of the update holds
(``--max-tokens-per-micro-batch``; docs/design.md, "Micro-batches that fit the memory"): a number
given, empty (by rows: ``--rollout-micro-batch-size``, ``--train-micro-batch-size``), or ``auto``,
the default -- chosen when the run starts from what a token of a pass with a gradient holds and
the memory free then.

A pass with a gradient keeps every layer's activations for its backward pass.  Counted on
SmolLM2-135M with LoRA (tensors saved for the backward pass, per token and layer, in float32):
4 x 1,536 of the MLP, 3 x 576 and 2 x 192 of the attention, 7 x 16 of the adapters -- 8,368
elements, 4 x (hidden + intermediate) to 1%.  The pass's peak resident memory is 2.3-2.6 times
that (the backward pass's gradients beside the kept activations, and the allocator's pieces it
does not hand back), measured at 1,300 to 5,200 tokens a pass (docs/design.md gives the table).
So a token costs ``PEAK_PER_KEPT x 4 x (hidden + intermediate) x layers`` bytes of its element
size, plus, where they are there, what does not shrink with the sdpa kernels: an eager attention's
scores over its row's positions, the model's own (positions, vocabulary) logits where the fused
output layer is off.

Auto gives a pass half of the memory free at start, less what the optimizer has still to make
(gradients and AdamW's two moments of each trained weight), and on a CPU at most 4 GiB: a CPU runs
a pass of 650 tokens as fast a token as one of 5,200, so larger passes only take memory.  Where a
batch's rows all fit in the budget, they are cut by rows, as without one.  Under FSDP every
process takes the smallest memory any of them has, so all cut alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AUTO = "auto"
KEPT_PER_LAYER = 4  # x (hidden + intermediate): the elements a token's layer keeps for the backward pass
PEAK_PER_KEPT = 2.5  # a pass's peak memory over what it keeps (measured 2.3-2.6, SmolLM2 + LoRA, CPU)
SHARE_OF_FREE = 0.5  # of the memory free at start: the rest for the rollout, the estimate's error, the others
CPU_CEILING = 4 * 2**30  # bytes of a pass on a CPU: larger passes run no faster a token there
GRAIN = 256  # budgets in steps of this many tokens: a few MB more or less free changes nothing
OPTIMIZER_BYTES = 12  # a trained float32 weight's gradient and AdamW's two moments, made at the first step


@dataclass(frozen=True)
class TokenCost:
    """Bytes one token holds at the peak of a pass with a gradient: ``flat``, plus ``per_position``
    for each position of its row (an eager attention's scores), plus ``own_logits`` where the
    passes take the model's own logits (the fused output layer off)."""

    flat: int
    per_position: int = 0
    own_logits: int = 0

    def bytes(self, width: int, fused: bool = True) -> int:
        return self.flat + self.per_position * width + (0 if fused else self.own_logits)


def token_cost(model_config, element_bytes: int, checkpointing: bool = False) -> TokenCost:
    """What a token of ``model_config``'s model (a transformers config) holds in a pass with a
    gradient, its activations ``element_bytes`` each.  With gradient checkpointing each layer
    keeps only its input (``hidden``), and one layer at a time is recomputed whole."""
    config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    hidden, layers = config.hidden_size, config.num_hidden_layers
    intermediate = (getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
                    or getattr(config, "ffn_dim", None) or 4 * hidden)
    one_layer = KEPT_PER_LAYER * (hidden + intermediate)
    kept = layers * hidden + one_layer if checkpointing else layers * one_layer
    # Eager attention keeps each head's scores and their softmax: 2 x heads for each position of the row.
    eager = getattr(config, "_attn_implementation", None) == "eager"
    per_position = 2 * config.num_attention_heads * (1 if checkpointing else layers) if eager else 0
    # The model's own logits of a token, their log-softmax and its gradient.
    own_logits = 3 * getattr(config, "vocab_size", 0)
    scale = PEAK_PER_KEPT * element_bytes
    return TokenCost(round(kept * scale), round(per_position * scale), round(own_logits * scale))


@dataclass(frozen=True)
class TokenBudget:
    """The budget of a run: ``given`` (a number, or None: by rows), or auto's ``room`` (bytes a pass
    may fill) at ``cost`` a token, with what it was chosen from (``free``, ``kept_back``, ``ceiling``:
    bytes) for the plan to say."""

    given: int | None = None
    auto: bool = False
    room: int = 0
    cost: TokenCost | None = None
    free: int = 0
    kept_back: int = 0
    ceiling: int | None = None

    def tokens(self, width: int, fused: bool = True) -> int | None:
        """Tokens a micro-batch holds when its longest row takes ``width`` positions; None: by rows."""
        if not self.auto:
            return self.given
        fit = self.room // self.cost.bytes(width, fused)
        return fit // GRAIN * GRAIN if fit >= GRAIN else max(fit, 1)

    def for_rows(self, tokens: int, width: int, fused: bool = True) -> int | None:
        """The budget for cutting rows whose passes would run ``tokens`` positions in all, the
        longest row ``width``: auto's for that width, or None (by rows) where it holds them all."""
        if not self.auto:
            return self.given
        budget = self.tokens(width, fused)
        return None if tokens <= budget else budget


def auto_budget(models: list, element_bytes: int, checkpointing: bool, free: int, trained: int,
                on_cpu: bool, agree=None) -> TokenBudget:
    """Auto's budget for passes through ``models`` (the actor, and a critic with a trunk of its own:
    each runs its backward pass alone, so the larger one counts), with ``free`` bytes free at start
    and ``trained`` weights to train (their gradients and AdamW moments are still to come).
    ``agree``: the smallest of every process's room (under FSDP every process cuts alike)."""
    costs = [token_cost(model.config, element_bytes, checkpointing) for model in models]
    cost = max(costs, key=lambda c: (c.flat, c.per_position, c.own_logits))
    kept_back = trained * OPTIMIZER_BYTES
    room = int(SHARE_OF_FREE * max(free - kept_back, 0))
    ceiling = CPU_CEILING if on_cpu else None
    if ceiling is not None:
        room = min(room, ceiling)
    if agree is not None:
        room = agree(room)
    return TokenBudget(auto=True, room=room, cost=cost, free=free, kept_back=kept_back, ceiling=ceiling)


def run_budget(config, actor, critic, trainable_parameters, device: torch.device, processes_sharing: int = 1,
               agree=None) -> TokenBudget:
    """The run's budget from its config: the number given, none, or auto's (:func:`auto_budget`) for
    ``actor`` and a critic with a trunk of its own, measured now on ``device``.
    ``processes_sharing``: the processes the trained weights are sharded over (FSDP; 1 otherwise)."""
    if config.max_tokens_per_micro_batch != AUTO:
        return TokenBudget(given=config.max_tokens_per_micro_batch)
    from ppo_rlhf.hardware import free_memory
    from ppo_rlhf.models.loading import base_of

    models = [base_of(actor)] + ([critic.backbone] if hasattr(critic, "backbone") else [])
    if config.mixed_precision in ("bf16", "fp16"):
        element_bytes = 2
    else:  # the widest weights' (trained float32 adapters on a half-precision base compute in float32)
        element_bytes = max(p.element_size() for model in models for p in model.parameters())
    trained = sum(p.numel() for p in trainable_parameters) // processes_sharing
    return auto_budget(models, element_bytes, config.gradient_checkpointing, free_memory(device), trained,
                       device.type == "cpu", agree)


def gib(count: int) -> str:
    return f"{count / 2**30:.1f} GiB"


def describe(budget: TokenBudget, width: int, fused: bool = True) -> str:
    """Where auto's budget comes from, for the plan: the room a pass takes and what a token of a
    ``width``-position row costs."""
    share = f"half of the {gib(budget.free)} free at start" if SHARE_OF_FREE == 0.5 else \
        f"{SHARE_OF_FREE:.0%} of the {gib(budget.free)} free at start"
    if budget.kept_back >= 2**27:  # a full model's gradients and moments; a LoRA adapter's are not worth a word
        share += f" less {gib(budget.kept_back)} for the gradients and AdamW moments"
    if budget.ceiling is not None:
        share += f", at most {gib(budget.ceiling)} on a CPU"
    cost = budget.cost.bytes(width, fused)
    return f"auto: {gib(budget.room)} a pass -- {share} -- at {cost / 2**20:.2f} MiB a token with a gradient"
