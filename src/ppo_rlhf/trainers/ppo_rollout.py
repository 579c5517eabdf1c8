"""Stages 1-2 of a PPO iteration, roll out and score (docs/design.md, "One PPO iteration"): the
actor plays this process's rows (one turn each, or episodes with an environment), the rewards score
them, and each score is shaped on its own; DAPO's dynamic sampling draws again until the kept
groups fill the batch, and ReMax rolls out its greedy baseline.  What needs the whole batch waits
for stage 5 (trainers/ppo_advantages.py).  :class:`RolloutStage` is the part of PPOTrainer these
are; a new source of rollouts or a new shaping of a score enters here."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ppo_rlhf.config import ConfigError
from ppo_rlhf.core import informative_groups, overlong_penalty
from ppo_rlhf.distributed import gather_rows, max_across_processes, sum_across_processes
from ppo_rlhf.envs import environment_source
from ppo_rlhf.rollout.agents import AgentSource
from ppo_rlhf.rollout.episodes import Episodes, episode_seeds, roll_out, score_episodes
from ppo_rlhf.rollout.generation import Generator, TorchGenerator
from ppo_rlhf.rollout.reward import unscored_rows
from ppo_rlhf.sharding import gathered
from ppo_rlhf.trainers.estimators import check_prompt_groups
from ppo_rlhf.trainers.ppo_async import Generated
from ppo_rlhf.trainers.ppo_batch import Rollout
from ppo_rlhf.trainers.ppo_config import PPOConfig
from ppo_rlhf.trainers.ppo_setup import episode_objects


def environments_of(config: PPOConfig, environment=None, tools: list | None = None):
    """The EnvironmentSource of the run's episodes (envs/__init__.py), from the config and what was
    given in Python (recorded in the config already: ``record_given_episodes``); None: single-turn
    rollouts.  Episode options without episodes are refused here, at start: a config may be built
    with them for objects given to the trainer."""
    config.check_episode_options_used()
    if config.agent is not None:  # an agent plays the episodes itself, on the server's OpenAI endpoint
        return AgentSource(config.agent, config.env_workers)
    environment, tools = episode_objects(config, environment, tools)
    source = environment_source(environment, tools, tool_parser=config.tool_parser,
                                tool_timeout=config.tool_timeout, env_workers=config.env_workers,
                                environment_config=config.environment_config,
                                action_names=config.action_names or None, observation_text=config.observation_text)
    if source is not None and config.turn_rewards == "per-turn" and not source.pays_per_turn:
        # TRL's classes and tools reward an episode once it ends (get_reward, reward functions):
        # per-turn would place that reward where sum does, and say it did more.
        raise ConfigError(f"invalid value for 'turn_rewards': 'per-turn' with {source.description}, which rewards no "
                          f"turn on its own (TRL's environment classes and tools have no step reward: get_reward() "
                          f"and the reward functions score the finished episode); leave --turn-rewards out (sum), "
                          f"or give an environment of gymnasium's shape, whose step() returns each turn's reward")
    return source


class RolloutStage:
    """Stages 1-2 of PPOTrainer (module docstring)."""

    def roll_out(self, rows: list[dict], metrics: dict[str, float]) -> Rollout:
        """Stages 1-2 on this process's ``rows``: episodes played by the actor (one turn each without
        an environment), then scored, each score shaped on its own (missing EOS, overlong) -- what
        needs the whole batch waits for the gathered batch.  Rows an asynchronous run's worker has
        already played (trainers/ppo_async.py, ``Generated``) are only scored."""
        config = self.config
        prompts = [row.get(config.prompt_field) for row in rows]
        check_prompt_groups(prompts, config.samples_per_prompt)
        if isinstance(rows, Generated):
            episodes, versions = rows.episodes, rows.versions
            metrics["time/generate"] += rows.waited  # the trainer's wait; the worker's own seconds beside it
            metrics["async/generate_seconds"] = metrics.get("async/generate_seconds", 0.0) + rows.seconds
        else:
            start = time.perf_counter()
            episodes = self.generate_episodes(rows, self.generator, self.environment_seeds(len(rows)))
            # An engine with weights of its own (vllm) reports the seconds it took to receive the actor's.
            sync = getattr(self.generator, "last_sync_seconds", None)
            if sync is not None:
                metrics["time/weight_sync"] = metrics.get("time/weight_sync", 0.0) + sync
            metrics["time/generate"] += time.perf_counter() - start - (sync or 0.0)
            versions = getattr(self.generator, "last_versions", None)
        if versions is not None:  # a generation server's: the policy version that sampled each row
            self.sampled_versions += [version for version in versions if version is not None]
        start = time.perf_counter()
        raw_scores, components, unscored = self.score(rows, episodes)
        metrics["time/score"] += time.perf_counter() - start
        finished = torch.tensor(episodes.finished, device=self.device)
        scores, turn_rewards = self.place_turn_rewards(raw_scores, episodes)
        scores = self.shape_scores(scores, finished, episodes.sequences.loss_mask.sum(dim=1))
        return Rollout(rows, episodes, finished, raw_scores, scores, components, turn_rewards, unscored=unscored)

    def generate_episodes(self, rows: list[dict], generator: Generator, seeds: list[int] | None) -> Episodes:
        """Stage 1: this process's ``rows`` played by the actor on ``generator`` (the run's, or an
        asynchronous run's worker's), environments reset from ``seeds``."""
        prompts = [row.get(self.config.prompt_field) for row in rows]
        with gathered(self.actor):  # sharded: the whole actor, gathered once for the whole rollout
            return roll_out(self.actor, self.tokenizer, generator, rows, prompts, self.episode_limits,
                            self.environments, seeds)

    def staleness_metrics(self, metrics: dict[str, float]) -> None:
        """How many policy versions old the rows trained on were sampled, over every process
        (a generation server's runs: docs/design.md, "Asynchronous rollouts"), and the samples an
        asynchronous run dropped as too old."""
        if not self.sampled_versions and self.rollouts is None:
            return
        staleness = torch.tensor([float(self.iteration - version) for version in self.sampled_versions])
        summed = sum_across_processes(torch.tensor([staleness.sum().item(), float(len(staleness))],
                                                   device=self.device))
        metrics["staleness/mean"] = (summed[0] / summed[1]).item() if summed[1] > 0 else 0.0
        metrics["staleness/max"] = float(max_across_processes(int(staleness.max().item()) if len(staleness) else 0))
        if self.rollouts is not None:
            dropped = sum_across_processes(torch.tensor([float(self.rollouts.dropped)], device=self.device))
            metrics["staleness/dropped"] = dropped.item()
            self.rollouts.dropped = 0

    def environment_seeds(self, rows: int) -> list[int] | None:
        """This process's episodes' environment seeds (rollout/episodes.py, episode_seeds); None
        without an environment.  Each call within an iteration is a new draw."""
        if self.environments is None:
            return None
        k = self.config.samples_per_prompt
        self.draws += 1
        return episode_seeds(self.config.seed, self.iteration, self.draws, self.rank * rows // k, rows // k, k)

    def batch_seeds(self, index: int, rows: int) -> list[int] | None:
        """The environment seeds of an asynchronous run's batch ``index``: those a synchronous run
        gives the first draw of iteration ``index``."""
        if self.environments is None:
            return None
        k = self.config.samples_per_prompt
        return episode_seeds(self.config.seed, index, 1, self.rank * rows // k, rows // k, k)

    def score(self, rows: list[dict], episodes: Episodes
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        """(b,) scores as the rewards gave them (the environment's included), on the trainer's
        device, each reward's own (b,) scores by name, and (b,) which rows a reward could not score."""
        raw, parts = score_episodes(self.reward, rows, episodes, self.config.environment_reward_weight)
        unscored = unscored_rows(self.reward, len(rows)).to(self.device)
        if raw is None:  # no reward but a teacher's (--teacher alone): the score is 0, the signal per token
            return torch.zeros(len(rows), device=self.device), {}, unscored
        # A reward function's scores come on the CPU.
        return raw.to(self.device).float(), {name: part.to(self.device) for name, part in parts.items()}, unscored

    def place_turn_rewards(self, raw_scores: torch.Tensor, episodes: Episodes
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """--turn-rewards per-turn: the environment's step rewards moved from the episode's score to
        the last model token of each turn they answered, (b, T); the score keeps the rest."""
        if self.config.turn_rewards != "per-turn" or not episodes.environments:
            return raw_scores, None
        weight = self.config.environment_reward_weight
        turn_rewards = torch.zeros_like(episodes.sequences.loss_mask, dtype=torch.float32, device=self.device)
        for row, (ends, steps) in enumerate(zip(episodes.turn_ends, episodes.step_rewards)):
            for end, reward in zip(ends, steps):
                if end is not None:  # a turn with no model token before it keeps its reward in the score
                    turn_rewards[row, end] += weight * reward
        return raw_scores - turn_rewards.sum(dim=1), turn_rewards

    def shape_scores(self, scores: torch.Tensor, finished: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Each response's score on its own: --missing-eos-penalty, --overlong-buffer."""
        config = self.config
        if config.missing_eos_penalty is not None:
            scores = torch.where(finished, scores, scores - config.missing_eos_penalty)
        if config.overlong_buffer is not None:
            scores = scores + overlong_penalty(lengths.to(scores.device), config.max_new_tokens, config.overlong_buffer,
                                               config.overlong_penalty)
        return scores

    def keep_informative_groups(self, rollout: Rollout, draw_more: Callable[[], list[dict]] | None,
                                metrics: dict[str, float]) -> Rollout:
        """DAPO's dynamic sampling (docs/design.md, "Policy-loss variants"): the prompt groups whose
        K rewards (--dynamic-sampling-on) are all equal -- all right or all wrong -- are dropped, and
        more prompts are rolled out until the kept groups fill the batch, for at most --max-resample-rounds extra
        rounds; a batch still short then is completed with dropped groups, marked ``filler``: their
        advantages are set to 0 (DAPO trains on no dropped group; under --dynamic-sampling-on accuracy
        their shaped scores may still differ), so every update sees batch_size sequences and learns
        from the kept groups alone.  Decided on the gathered scores, in every process alike; each
        process then keeps its own rows of the chosen groups."""
        config, k = self.config, self.config.samples_per_prompt
        wanted = config.batch_size // k  # groups in the whole batch
        # accuracy: the rewards as they came (DAPO filters on the task's accuracy), so a group all
        # right stays one whatever lengths the overlong shaping penalises; score: after shaping.
        decided_on = "raw_scores" if config.dynamic_sampling_on == "accuracy" else "scores"
        first = gather_rows(rollout.raw_scores)
        metrics["score"], metrics["score_std"] = first.mean().item(), first.std(unbiased=False).item()
        rounds: list[tuple[Rollout, torch.Tensor]] = []  # (this process's rollout, informative flag of every group)
        found, generated_tokens = 0, 0.0
        while True:
            informative = informative_groups(gather_rows(getattr(rollout, decided_on)).reshape(-1, k),
                                             ~gather_rows(rollout.unscored).reshape(-1, k))  # (groups,)
            generated_tokens += sum_across_processes(rollout.sequences.loss_mask.sum().float()).item()
            rounds.append((rollout, informative))
            found += int(informative.sum())
            if found >= wanted or len(rounds) > config.max_resample_rounds:
                break
            if draw_more is None:
                raise ValueError("dynamic sampling needs draw_more, a source of more prompt rows")
            rollout = self.roll_out(draw_more(), metrics)
        # The first `wanted` informative groups, in order of rounds and of processes; then, if short,
        # the first dropped groups to fill the batch.
        informative_left, fill_left = wanted, max(wanted - found, 0)
        parts = []
        for part, informative in rounds:
            take = informative & (informative.cumsum(0) <= informative_left)
            fill = ~informative & ((~informative).cumsum(0) <= fill_left)
            informative_left -= int(take.sum())
            fill_left -= int(fill.sum())
            mine = (take | fill).reshape(self.processes, -1)[self.rank]  # this process's groups of the round
            filled = fill.reshape(self.processes, -1)[self.rank]
            rows = mine.repeat_interleave(k).nonzero().squeeze(1)
            parts.append(part.select(rows.tolist()))
            parts[-1].filler = filled.repeat_interleave(k)[rows].to(part.finished.device)
        kept = min(found, wanted)
        metrics.update({
            "dynamic_sampling/rounds": len(rounds),
            "dynamic_sampling/dropped_groups": sum(int((~informative).sum()) for _, informative in rounds),
            "dynamic_sampling/filled_groups": wanted - kept,
            # The price of the filter: response tokens generated per sequence that carries a signal.
            "dynamic_sampling/generated_tokens": generated_tokens,
            "dynamic_sampling/generated_tokens_per_kept_sample": generated_tokens / (kept * k) if kept else float("nan"),
        })
        return Rollout.concat(parts, self.tokenizer.pad_token_id)

    def greedy_baseline(self, rollout: Rollout, metrics: dict[str, float]) -> tuple[torch.Tensor, torch.Tensor]:
        """ReMax: the shaped score (one per prompt) of each prompt's greedy response, and whether a
        reward could not score it."""
        k = self.config.samples_per_prompt
        start = time.perf_counter()
        rows, prompts = rollout.rows[::k], [row.get(self.config.prompt_field) for row in rollout.rows[::k]]
        seeds = None if self.environments is None else rollout.episodes.seeds[::k]
        with gathered(self.actor):
            greedy = roll_out(self.actor, self.tokenizer, self.greedy_generator, rows, prompts, self.episode_limits,
                              self.environments, seeds)
        metrics["time/generate"] += time.perf_counter() - start
        start = time.perf_counter()
        raw, _, unscored = self.score(rows, greedy)
        metrics["time/score"] += time.perf_counter() - start
        finished = torch.tensor(greedy.finished, device=self.device)
        return self.shape_scores(raw, finished, greedy.sequences.loss_mask.sum(dim=1)), unscored

    def decoding(self, do_sample: bool, temperature: float = 1.0, seed: int | None = None) -> Generator:
        """The rollout engine with other decoding settings (ReMax's greedy baseline, the in-run
        evaluations): the same engine where it offers them (vLLM holds one per process), else the
        built-in loop with the run's stop ids and length."""
        if hasattr(self.generator, "with_decoding"):
            return self.generator.with_decoding(do_sample, temperature, seed)
        return TorchGenerator(self.generator.stop_token_ids, self.tokenizer.pad_token_id, self.config.max_new_tokens,
                              do_sample=do_sample, temperature=temperature, seed=seed)
