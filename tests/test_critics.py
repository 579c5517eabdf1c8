"""One critic interface (models/value.py): a value head on the actor's trunk, a model of its own and
an adapter on a LoRA base are built by trainers/roles.py, and the trainer uses each the same way:
values over the response, trained weights that move, a folder that saves and loads them.  A
critic-free estimator gets none, and a critic a user writes plugs in through the same interface."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ppo_rlhf.config import build_config
from ppo_rlhf.models import Critic, ModelCritic, SharedHeadCritic
from ppo_rlhf.models.lora import AdapterCritic
from ppo_rlhf.models.value import values_over_response
from ppo_rlhf.rollout.generation import TorchGenerator
from ppo_rlhf.trainers.roles import load_roles
from ppo_rlhf.trainers.ppo import PPOTrainer
from ppo_rlhf.trainers.ppo_config import PPOConfig
from zoo import PROMPTS, REWARDS_MODULE

ROWS = [{"prompt": p} for p in PROMPTS[:4]]
KINDS = {  # name: (settings, the critic class load_roles builds)
    "shared": ({"critic": "shared"}, SharedHeadCritic),
    "separate": ({"critic": "separate"}, ModelCritic),
    "lora-shared": ({"critic": "shared", "lora": True}, SharedHeadCritic),
    "lora-separate": ({"critic": "separate", "lora": True}, ModelCritic),
    "lora-adapter": ({"critic": "lora", "lora": True}, AdapterCritic),
}


def settings(zoo, **overrides) -> dict:
    return {"model": str(zoo["llama"]), "reward_fn": f"{REWARDS_MODULE}:length_score", "batch_size": 4,
            "mini_batch_size": 2, "ppo_epochs": 1, "max_new_tokens": 6, "max_length": 64, "lr": 1e-2,
            "lora_r": 4, "lora_alpha": 8, "seed": 0, **overrides}


def trainer_from_roles(config: PPOConfig) -> PPOTrainer:
    torch.manual_seed(0)
    roles = load_roles(config, None)
    generator = TorchGenerator(roles.tokenizer.eos_token_id, roles.tokenizer.pad_token_id, config.max_new_tokens,
                               do_sample=True, seed=0)
    return PPOTrainer(config, roles.reward, model=roles.actor, ref=roles.ref, tokenizer=roles.tokenizer, generator=generator,
                      critic=roles.critic)


def critic_weights(trainer: PPOTrainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.critic.named_parameters()}


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_critic_kind_gives_values_trains_and_round_trips_through_its_folder(zoo, tmp_path, kind):
    overrides, expected = KINDS[kind]
    config = build_config(PPOConfig, settings(zoo, **overrides))
    trainer = trainer_from_roles(config)
    assert type(trainer.critic) is expected
    experience, _ = trainer.make_experience(ROWS)
    assert experience.values.shape == experience.mask.shape and experience.values.dtype == torch.float32
    before = critic_weights(trainer)
    trainer.update(experience)
    moved = [name for name, p in trainer.critic.named_parameters() if not torch.equal(p, before[name])]
    assert moved and any("value_head" in name for name in moved), kind
    # The trainer's optimizer holds the critic's trained tensors, each once, beside the actor's.
    actor_group, critic_group = ({id(p) for p in g["params"]} for g in trainer.optimizer.param_groups)
    assert critic_group == {id(p) for p in trainer.critic.parameters() if p.requires_grad}
    assert not actor_group & critic_group

    trainer.critic.save(tmp_path / "critic", trainer.tokenizer)
    with torch.no_grad():
        trainer.critic.eval()
        values = trainer.policy_and_values(experience.sequences)[1]
    fresh = trainer_from_roles(config)
    fresh.actor.load_state_dict(trainer.actor.state_dict())  # a shared head reads the actor's trunk
    fresh.critic.load_saved(tmp_path / "critic")
    with torch.no_grad():
        fresh.actor.eval()
        fresh.critic.eval()
        reloaded = fresh.policy_and_values(experience.sequences)[1]
    assert torch.allclose(values, reloaded, atol=1e-6), kind


def test_a_critic_free_estimator_builds_no_critic(zoo):
    config = build_config(PPOConfig, settings(zoo, estimator="rloo", samples_per_prompt=2))
    roles = load_roles(config, None)
    assert roles.critic is None
    trainer = trainer_from_roles(config)
    assert trainer.critic is None
    experience, _ = trainer.make_experience([row for row in ROWS[:2] for _ in range(2)])
    assert experience.values is None


class EmbeddingCritic(Critic):
    """A critic a user might write: a linear value of the actor's input embedding of each token,
    with its own forward pass (not the actor's hidden states)."""

    def __init__(self, actor: nn.Module):
        super().__init__()
        self.embedding = copy.deepcopy(actor.get_input_embeddings()).requires_grad_(False)
        self.linear = nn.Linear(self.embedding.embedding_dim, 1)

    def values(self, sequences, actor_hidden=None):
        full = self.linear(self.embedding(sequences.input_ids)).squeeze(-1)  # (B, P+T)
        return values_over_response(full, sequences)

    def save(self, path, tokenizer=None, dtype=None):
        path.mkdir(parents=True, exist_ok=True)
        torch.save(self.linear.state_dict(), path / "linear.pt")

    def load_saved(self, path):
        self.linear.load_state_dict(torch.load(path / "linear.pt"))


def test_a_critic_written_by_a_user_plugs_into_the_trainer(zoo):
    config = build_config(PPOConfig, settings(zoo, critic="shared"))
    roles = load_roles(config, None)
    critic = EmbeddingCritic(roles.actor)
    generator = TorchGenerator(roles.tokenizer.eos_token_id, roles.tokenizer.pad_token_id, config.max_new_tokens,
                               do_sample=True, seed=0)
    trainer = PPOTrainer(config, roles.reward, model=roles.actor, ref=roles.ref, tokenizer=roles.tokenizer, generator=generator,
                         critic=critic)
    experience, _ = trainer.make_experience(ROWS)
    assert experience.values.shape == experience.mask.shape
    before = critic.linear.weight.detach().clone()
    stats = trainer.update(experience)
    assert "vf_loss" in stats and not torch.equal(before, critic.linear.weight)
    assert critic.embedding.weight.grad is None  # only what the critic trains is trained
