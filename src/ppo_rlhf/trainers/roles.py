"""The four PPO roles -- actor, reference, reward, critic -- built from a PPOConfig, in one place
(docs/design.md, "Roles").  Each is loaded in its stored dtype (or ``--dtype``); the trainer then
puts every role on its device and upcasts what it trains to float32 (hardware.py).

Full models: the actor and a frozen reference are two copies of ``--model``; the reward is a
model folder or a function; the critic (models/value.py) is a value head on the actor's trunk
(``--critic shared``), a model of its own (``separate``), or none for a critic-free estimator.

``--lora``: one base in memory (models/lora.py).  The actor is the base + a policy adapter,
the reference is the base with adapters disabled, a reward adapter trained on the same base
(``rm --lora``) runs on it too, and ``--critic lora`` gives the critic an adapter of its own,
initialised from the reward adapter when there is one (as a separate critic starts from the
reward model).  A reward model that is not an adapter of this base loads as a model of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ppo_rlhf.config import ConfigError
from ppo_rlhf.models import (
    Critic,
    ModelCritic,
    SharedHeadCritic,
    load_causal_lm,
    load_sequence_classifier,
    load_tokenizer,
    same_vocabulary,
)
from ppo_rlhf.models.value import ValueHead
from ppo_rlhf.models.loading import (
    TOKENIZER_FILES,
    ModelError,
    adapter_base_path,
    adapter_merge_dtype,
    check_vocabulary,
    enable_activation_checkpointing,
    is_adapter_only,
    read_adapter,
    require_model_folder,
    score_head_from,
)
from ppo_rlhf.models.lora import AdapterCritic, AdapterRewardModel, add_adapter_from, with_adapter
from ppo_rlhf.rollout.reward import CombinedReward, FunctionReward, ModelReward, ScoringReward
from ppo_rlhf.rollout.judge import LocalJudge, make_judge
from ppo_rlhf.rollout.reward_http import UrlReward
from ppo_rlhf.trainers.estimators import uses_critic
from ppo_rlhf.trainers.ppo_config import PPOConfig
from ppo_rlhf.trainers.teacher import TEACHER, Teacher, add_teacher_adapter, load_teacher

POLICY, CRITIC, REWARD = "policy", "critic", "reward"  # adapter names on the shared base


@dataclass
class Roles:
    actor: object  # causal LM, or a peft model with the policy adapter active
    ref: object | None  # None: the actor's base with adapters disabled
    reward: CombinedReward | None  # the reward model, functions and URL, summed; None: the environment's alone
    critic: Critic | None  # SharedHeadCritic, ModelCritic or AdapterCritic; None: a critic-free estimator
    tokenizer: object
    teacher: Teacher | None = None  # --teacher (trainers/teacher.py); None: no distillation


def load_roles(config: PPOConfig, task, functions: list | None = None, reward=None) -> Roles:
    """``functions``: the rewards that need no model (:func:`reward_functions`), when the caller
    built them already to check the data's columns before loading any model.  ``reward``: one
    given in Python (:func:`as_reward`), used instead of the config's."""
    if config.model is None:
        raise ConfigError("no actor: give --model DIR (the SFT checkpoint)")
    if config.lora:
        roles = load_single_base_roles(config, task, functions, reward)
    else:
        # The model before its tokenizer: a folder of the wrong kind is then named as such.
        actor, ref = load_causal_lm(config.model, config.load_dtype), load_causal_lm(config.model, config.load_dtype)
        tokenizer = load_tokenizer(config.model)
        reward = build_reward(config, tokenizer, task, functions) if reward is None else as_reward(reward, config, tokenizer, task)
        teacher = load_teacher(config.teacher, tokenizer, config.load_dtype) if config.teacher else None
        roles = Roles(actor, ref, reward, build_critic(config, tokenizer, actor), tokenizer, teacher)
    if config.gradient_checkpointing:
        # Only the trained models: the reference and the reward never run a backward pass.
        enable_activation_checkpointing(roles.actor)
        if roles.critic is not None:
            roles.critic.enable_gradient_checkpointing()
    return roles


def load_single_base_roles(config: PPOConfig, task, functions: list | None = None, given_reward=None) -> Roles:
    base = load_causal_lm(config.model, config.load_dtype)
    tokenizer = load_tokenizer(config.model)
    actor = with_adapter(config, base, "CAUSAL_LM", adapter_name=POLICY)
    reward_adapter = None  # (LoRA config, LoRA weights) of a reward adapter trained on this base
    if given_reward is not None:
        reward = as_reward(given_reward, config, tokenizer, task)
    elif config.reward_model and is_adapter_of(config.reward_model, config.model):
        adapter_config, lora_weights, head_weights = read_adapter(config.reward_model)
        reward_adapter = adapter_config, lora_weights
        add_adapter_from(actor, REWARD, *reward_adapter)
        score_head = score_head_from(head_weights, config.reward_model)
        model_reward = ModelReward(AdapterRewardModel(actor, REWARD, score_head), load_tokenizer(config.reward_model),
                                   tokenizer, label_field=config.label_field, chat_template=config.chat_template,
                                   description=f"model {config.reward_model} (an adapter on the shared base)")
        reward = build_reward(config, tokenizer, task, functions, model_reward)
    else:
        reward = build_reward(config, tokenizer, task, functions)

    critic = None
    if not uses_critic(config.estimator):
        pass
    elif config.critic == "lora":
        if reward_adapter is not None:  # the critic starts as the reward model, as a separate critic would
            add_adapter_from(actor, CRITIC, *reward_adapter)
            critic = AdapterCritic(actor, CRITIC, value_head_from(score_head))
        else:
            # The critic reads hidden states into its value head: the output layer is not its.
            actor.add_adapter(CRITIC, config.lora_config("CAUSAL_LM", base, output_layer=False))
            critic = AdapterCritic(actor, CRITIC)
    else:
        critic = build_critic(config, tokenizer, actor)

    # A teacher trained as an adapter on this base (a --lora run's actor) is one more adapter on it.
    teacher = None
    if config.teacher:
        teacher = (add_teacher_adapter(actor, config.teacher) if is_adapter_of(config.teacher, config.model)
                   else load_teacher(config.teacher, tokenizer, config.load_dtype))

    # Which adapters train is decided here, once: peft's add/set_adapter also toggle it.
    actor.set_adapter(POLICY)
    trained = [POLICY] + ([CRITIC] if config.critic == "lora" else [])
    actor.set_requires_grad(trained, True)
    frozen = [name for name, present in ((REWARD, reward_adapter is not None),
                                         (TEACHER, teacher is not None and teacher.model is None)) if present]
    if frozen:
        actor.set_requires_grad(frozen, False)
    return Roles(actor, None, reward, critic, tokenizer, teacher)


def value_head_from(score) -> ValueHead:
    """A value head starting as a one-output reward head (a pairwise reward model's), else fresh."""
    head = ValueHead(score.in_features)
    if score.out_features == 1:
        with torch.no_grad():
            head.summary.weight.copy_(score.weight)
            head.summary.bias.copy_(score.bias if score.bias is not None else torch.zeros(1))
    return head


def is_adapter_of(adapter: str, model: str) -> bool:
    """Whether ``adapter`` is a LoRA adapter trained on the model folder ``model``."""
    return is_adapter_only(adapter) and adapter_base_path(adapter).resolve() == Path(model).resolve()


def float32_merges(config) -> list[str]:
    """The adapter folders a ppo config loads merged into a base stored in 16 bits, which ``--dtype
    auto`` holds and merges in float32 (models/loading.py, ``adapter_merge_dtype``): the model, the
    teacher, the reward model, a local judge.  An adapter that a --lora run adds to its shared base
    is not merged into it."""
    def merged(folder) -> bool:
        if not folder or (getattr(config, "lora", False) and is_adapter_of(folder, config.model)):
            return False
        return adapter_merge_dtype(folder, config.load_dtype) != config.load_dtype

    folders = [config.model, getattr(config, "teacher", None), config.reward_model, config.reward_judge]
    return list(dict.fromkeys(str(folder) for folder in folders if merged(folder)))


def float32_merge_note(folders: list[str]) -> str:
    """What the run's plan says of :func:`float32_merges`."""
    adapters = "a LoRA adapter" if len(folders) == 1 else "LoRA adapters"
    return (f"{', '.join(folders)}: {adapters} on a base stored in 16 bits, held and merged in float32, where the "
            f"update is not rounded away (--dtype bfloat16 holds it in bf16, in half the memory, each merged weight "
            f"rounded once)")


def reward_functions(config, task) -> list:
    """The rewards a stage builds before loading any model and checks the data's columns against
    (docs/design.md, "Rewards"): the functions, then the URL, then the judge (a local judge's model
    is loaded by :func:`build_reward`, after that check); or, when no reward at all is given, the
    task's rule."""
    functions = [FunctionReward(path, prompt_field=config.prompt_field) for path in config.reward_fn]
    if config.reward_url:
        functions.append(UrlReward(config.reward_url, config.prompt_field, config.reward_timeout,
                                   config.reward_retries, config.reward_backoff))
    if config.reward_judge:
        functions.append(make_judge(config))
    if not functions and not config.reward_model and task is not None:
        functions.append(FunctionReward(task.rule_reward, name=f"{task.name}.rule_reward",
                                        description=f"the {task.name} task's rule"))
    return functions


def build_reward(config, tokenizer, task, functions: list | None = None,
                 model_reward: ModelReward | None = None) -> CombinedReward | None:
    """Every reward of the run as one (PPOConfig or EvalConfig): the reward model first, then
    the functions and the URL, weighted by ``reward_weights`` in that order.  None when there is
    none, which the caller allowed: an environment's rewards are then the score (``require_a_reward``)."""
    functions = reward_functions(config, task) if functions is None else functions
    for part in functions:
        if isinstance(part, LocalJudge):
            part.load()
    if model_reward is None and config.reward_model:
        model = load_sequence_classifier(config.reward_model, config.load_dtype)
        model_reward = ModelReward(model, load_tokenizer(config.reward_model), tokenizer, label_field=config.label_field,
                                   chat_template=config.chat_template, description=f"model {config.reward_model}")
    parts = ([model_reward] if model_reward is not None else []) + functions
    return CombinedReward(parts, config.reward_weights) if parts else None


def shares_vocabulary(folder: str, tokenizer, actor) -> bool:
    """Whether the model in ``folder`` reads the actor's token ids as the same tokens: by its
    tokenizer when it has one, else (a critic checkpoint) by its vocabulary size."""
    folder = Path(folder)
    if not is_adapter_only(folder):
        require_model_folder(folder, "critic initialisation model")
    if any((folder / name).is_file() for name in TOKENIZER_FILES):
        return same_vocabulary(load_tokenizer(folder), tokenizer)
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(folder), "vocab_size", None) == actor.config.vocab_size


def critic_init_folder(config: PPOConfig, tokenizer, actor) -> str:
    """Where a separate critic starts.  It scores the actor's own token ids, position by
    position, so (unlike the reward model, which can re-encode text) it must share the actor's
    vocabulary: the reward model is the default only when it does, else the actor itself."""
    if config.critic_model:
        if not shares_vocabulary(config.critic_model, tokenizer, actor):
            raise ConfigError(f"--critic-model {config.critic_model} has a different vocabulary from the actor "
                              f"{config.model}; a separate critic reads the actor's token ids, so give a model "
                              f"with the actor's tokenizer (or leave --critic-model empty)")
        return config.critic_model
    if config.reward_model and shares_vocabulary(config.reward_model, tokenizer, actor):
        return config.reward_model
    return config.model


def build_critic(config: PPOConfig, tokenizer, actor) -> Critic | None:
    """The critic of a full-model run (``--critic lora`` is built with the adapters above)."""
    if not uses_critic(config.estimator):
        return None
    if config.critic == "shared":
        return SharedHeadCritic.on(actor)
    return ModelCritic.from_pretrained_trunk(critic_init_folder(config, tokenizer, actor), config.load_dtype)


def as_reward(reward, config: PPOConfig, tokenizer, task=None, environment_pays: bool = False) -> ScoringReward | None:
    """The reward a PPOTrainer was given, as one that scores a ScoringBatch (docs/design.md,
    "Rewards").  Accepted: None (the config's rewards, or the task's rule); a ScoringReward (used
    as it is); a Python function ``f(prompts, responses, **columns)``; a string -- ``module:function``
    or ``file.py:function``, else a reward-model folder; a sequence classifier (an ``nn.Module``,
    reading the policy's tokenizer); or a list of these, summed with ``config.reward_weights``.
    A thing that cannot score (a class for its instance, a causal LM, a model of a smaller
    vocabulary) is refused by name."""
    if reward is None:
        config.require_a_reward(environment_pays)
        return build_reward(config, tokenizer, task)
    if isinstance(reward, ScoringReward):
        # Used as it is, whatever the config names: load_roles hands a trainer the config's own
        # rewards this way, built from that config.
        return one_reward(reward, config, tokenizer)
    if config.reward_count():
        raise ConfigError("the rewards are given twice: as reward= and in the config (reward_model, reward_fn, "
                          "reward_url); give them in one place")
    parts = list(reward) if isinstance(reward, (list, tuple)) else [reward]
    return CombinedReward([one_reward(part, config, tokenizer) for part in parts], config.reward_weights)


def one_reward(reward, config: PPOConfig, tokenizer) -> ScoringReward:
    """One of the rewards :func:`as_reward` accepts."""
    if isinstance(reward, type) and issubclass(reward, ScoringReward):
        raise ConfigError(f"reward= {reward.__name__} is a class: give an instance of it, {reward.__name__}()")
    if isinstance(reward, ScoringReward):
        if type(reward).__call__ is ScoringReward.__call__:
            raise ConfigError(f"reward= {type(reward).__name__} is a ScoringReward without __call__(batch) -> (B,) "
                              f"scores: define it (docs/design.md, \"Rewards\")")
        return reward
    if isinstance(reward, (str, Path)) and Path(reward).is_dir():
        model = load_sequence_classifier(str(reward), config.load_dtype)
        return ModelReward(model, load_tokenizer(str(reward)), tokenizer, label_field=config.label_field,
                           chat_template=config.chat_template, description=f"model {reward}")
    if isinstance(reward, torch.nn.Module):
        check_reward_classifier(reward, tokenizer)
        return ModelReward(reward, tokenizer, tokenizer, label_field=config.label_field,
                           chat_template=config.chat_template, description=f"model {type(reward).__name__}")
    if isinstance(reward, str) or callable(reward):
        return FunctionReward(reward, prompt_field=config.prompt_field)
    raise ConfigError(f"reward {reward!r}: give a function, 'module:function', a reward-model folder, a sequence "
                      f"classifier, a ScoringReward or a list of these")


def check_reward_classifier(model: torch.nn.Module, tokenizer) -> None:
    """ModelError unless ``model``, given in Python as a reward, is a sequence classifier that can
    read the policy's token ids: a causal LM's outputs are next-token logits, not a score (the
    reward would be the logit of a token), and a smaller vocabulary indexes past its embeddings."""
    name = type(model).__name__
    if getattr(model, "get_output_embeddings", lambda: None)() is not None:
        raise ModelError(f"reward= is a {name}, a causal language model: its outputs are next-token logits, not a "
                         f"score; give a sequence classifier (...ForSequenceClassification, e.g. ppo-rlhf rm's "
                         f"checkpoints/reward) or a reward function")
    if getattr(getattr(model, "config", None), "num_labels", None) is None:
        raise ModelError(f"reward= is a {name}, which is not a sequence classifier (no config.num_labels); give "
                         f"a ...ForSequenceClassification, a reward function, or a ScoringReward")
    if hasattr(model, "get_input_embeddings"):  # a transformers model (a module of one's own may embed otherwise)
        check_vocabulary(model, tokenizer, f"reward= ({name}, reading the policy's token ids)")
