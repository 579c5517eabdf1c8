"""The teacher of on-policy distillation (``--teacher``; docs/design.md, "On-policy distillation").

The student samples; a frozen teacher scores every token the student wrote with its own
log-prob, in a pass of its own as the reference's, and the reward of each token is
``-teacher_coef * (log pi(x_t) - log teacher(x_t))`` (core/kl.py, ``teacher_reverse_kl``).  The
teacher reads the student's token ids, so both must share one tokenizer, and it must be a causal
LM other than the student, holding the student's sequences in its positions: checked at start.

Where the teacher lives, as the reference does:

- a model of its own: a Hugging Face folder, or a run's checkpoint (a ``--lora`` run's is an
  adapter, merged onto its base when loaded); frozen, on the trainer's device, sharded under an
  FSDP launch like the reference;
- with ``--lora``, a teacher that is an adapter trained on the student's own base (such a run's
  ``checkpoints/actor``): one more adapter on the shared base, :data:`TEACHER`, switched on for
  its pass as the reference's pass switches every adapter off.  One base in memory serves
  student, reference and teacher.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ppo_rlhf.config import ConfigError
from ppo_rlhf.models import load_causal_lm, load_tokenizer
from ppo_rlhf.models.loading import (ADAPTER_WEIGHTS, POLICY_CHECKPOINTS, TOKENIZER_FILES, ModelError,
                                     adapter_base_path, adapter_record, check_vocabulary, is_adapter_only, max_positions,
                                     read_adapter, refuse_critic)
from ppo_rlhf.models.lora import add_adapter_from

TEACHER = "teacher"  # the teacher's adapter name on a shared LoRA base
CAUSAL_LM = "CAUSAL_LM"  # peft's task type of a policy adapter (a reward adapter's: SEQ_CLS)


@dataclass
class Teacher:
    model: object | None  # a causal LM of its own; None: the TEACHER adapter on the actor's base
    description: str  # for the run's plan


def tokenizer_folder(teacher: str | Path) -> Path:
    """Where the teacher's tokenizer is: its folder, or for an adapter saved without one, its base's."""
    folder = Path(teacher)
    if is_adapter_only(folder) and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return adapter_base_path(folder)
    return folder


def special_ids(tokenizer) -> dict[str, tuple[str | None, int | None]]:
    """The special tokens a teacher must read as the student does: BOS (what a prompt starts with)
    and EOS (what ends a response), each (token, id).  The pad token is left out: padding is never
    scored, and a tokenizer without one pads with EOS here (models/loading.py)."""
    return {name: (getattr(tokenizer, f"{name}_token"), getattr(tokenizer, f"{name}_token_id")) for name in ("bos", "eos")}


def tokenizer_difference(teacher_tokenizer, tokenizer) -> str | None:
    """Why the teacher cannot read the student's token ids as the same tokens, or None when it can:
    another vocabulary size, another special token at BOS or EOS, or the same size with tokens at
    other ids."""
    if len(teacher_tokenizer) != len(tokenizer):
        return f"its tokenizer has {len(teacher_tokenizer)} tokens, the student's {len(tokenizer)}"
    ours, theirs = special_ids(tokenizer), special_ids(teacher_tokenizer)
    for name in ours:
        if ours[name] != theirs[name]:
            return (f"its {name.upper()} token is {theirs[name][0]!r} (id {theirs[name][1]}), the student's "
                    f"{ours[name][0]!r} (id {ours[name][1]})")
    vocabulary, teacher_vocabulary = tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    if vocabulary != teacher_vocabulary:
        token, index = next((t, i) for t, i in sorted(vocabulary.items(), key=lambda item: item[1])
                            if teacher_vocabulary.get(t) != i)
        theirs = teacher_vocabulary.get(token)
        return (f"token {token!r} is id {index} to the student and "
                + (f"id {theirs}" if theirs is not None else "not in the vocabulary") + " to the teacher")
    return None


def check_teacher(teacher: str, model: str | None, tokenizer, student: str) -> None:
    """At start, before any model loads: the teacher folder holds a causal LM other than the
    student ``model`` (None: one given in Python), whose tokenizer is the student's."""
    check_teacher_kind(teacher, model)
    check_teacher_tokenizer(teacher, tokenizer, student)


def check_teacher_kind(teacher: str, model: str | None) -> None:
    """ConfigError or ModelError unless ``teacher`` can give log-probs of the student's tokens: not
    the student's own folder (it would be the reference again, nothing to distil), not a critic
    (values, no tokens), not a reward adapter (a score head, no tokens).  A run folder is named
    with the model inside it when its tokenizer is looked for (:func:`check_teacher_tokenizer`);
    a full model folder of another kind, when it loads (models/loading.py, ``load_causal_lm``)."""
    folder = Path(teacher)
    if model is not None and folder.exists() and folder.resolve() == Path(model).resolve():
        raise ConfigError(f"invalid value for 'teacher': {teacher!r} is the student itself (--model): its log-probs "
                          f"are the reference's, so its reward is the KL penalty (--kl-coef) again and there is "
                          f"nothing to distil; give a stronger model of the same tokenizer, or leave --teacher out")
    refuse_critic(folder, "--teacher")
    if is_adapter_only(folder):
        task_type = adapter_record(folder).get("task_type")
        if task_type not in (None, CAUSAL_LM) or saves_a_score_head(folder):
            raise ModelError(f"--teacher {teacher} is a reward adapter (task_type {task_type}, a score head: ppo-rlhf "
                             f"rm --lora): it scores whole answers and has no log-probs of tokens to distil; give a "
                             f"causal LM, e.g. an sft or ppo run's checkpoints/sft or checkpoints/actor")


def saves_a_score_head(adapter: Path) -> bool:
    """Whether an adapter folder's weights hold a score head beside the LoRA matrices (peft's
    ``modules_to_save`` of a sequence classifier): read from the file's header, no tensor loaded."""
    from safetensors import safe_open

    weights = adapter / ADAPTER_WEIGHTS
    if not weights.is_file():
        return False
    with safe_open(str(weights), framework="pt") as file:
        return any(key.endswith("score.weight") for key in file.keys())


def check_teacher_fits(teacher: Teacher | None, max_length: int) -> None:
    """ModelError at start for a teacher of its own whose positions stop before --max-length: it
    scores the student's whole sequences (its vocabulary is checked as it loads, :func:`as_teacher`;
    an adapter on the shared base has the student's positions)."""
    if teacher is None or teacher.model is None:
        return
    positions = max_positions(teacher.model.config)
    if positions is not None and positions < max_length:
        raise ModelError(f"--teacher {teacher.description} has {positions} positions, but the student's sequences, "
                         f"which it scores whole, reach --max-length {max_length} tokens; lower --max-length to "
                         f"{positions}, or give a teacher with more positions")


def check_teacher_tokenizer(teacher: str, tokenizer, student: str) -> None:
    """ConfigError at start unless the teacher folder's tokenizer is the student's (see above)."""
    difference = tokenizer_difference(load_tokenizer(tokenizer_folder(teacher), "--teacher", POLICY_CHECKPOINTS),
                                      tokenizer)
    if difference is not None:
        raise ConfigError(f"--teacher {teacher} cannot score the student's tokens: {difference}. On-policy "
                          f"distillation reads the student's token ids with the teacher, so the teacher must share "
                          f"the student's tokenizer ({student}); give a teacher of the same tokenizer family")


def load_teacher(teacher: str, tokenizer, dtype=None) -> Teacher:
    """The teacher named by ``--teacher`` as a model of its own, in ``dtype`` (None: as stored); its
    tokenizer is checked first, before any model loads (:func:`check_teacher_tokenizer`)."""
    return as_teacher(load_causal_lm(teacher, dtype), tokenizer, teacher)


def add_teacher_adapter(peft_model, teacher: str) -> Teacher:
    """The teacher adapter ``teacher``, trained on the base of ``peft_model`` (a ``--lora`` actor),
    added to it as :data:`TEACHER`; the caller, which decides what trains, keeps it frozen."""
    adapter_config, lora_weights, _ = read_adapter(teacher)
    add_adapter_from(peft_model, TEACHER, adapter_config, lora_weights)
    return Teacher(None, f"{teacher}, an adapter on the shared base")


def as_teacher(model, tokenizer, description: str) -> Teacher:
    """A causal LM, frozen, as the teacher (one given in Python too); ModelError if the student's
    ids would index past its embeddings."""
    check_vocabulary(model, tokenizer, f"--teacher {description}")
    model.eval().requires_grad_(False)
    return Teacher(model, str(description))
