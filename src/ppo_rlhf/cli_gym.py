"""``ppo-rlhf gym`` (train PPO on a gymnasium env) and ``ppo-rlhf gym-eval`` (score a saved policy).

    ppo-rlhf gym --env CartPole-v1 --total-steps 100000 --seed 1 --out runs/cartpole
    ppo-rlhf gym-eval runs/cartpole --episodes 100

Precedence of settings: dataclass defaults < preset < ``--config`` YAML < flags.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from ppo_rlhf.config import RUN, SEEDS, add_config_arguments, at_least, config_from_args, option
from ppo_rlhf.config_yaml import load_yaml


@dataclass
class GymEvalConfig:
    """``gym-eval``'s options (the policy folder is its positional argument)."""

    # --- run folder, evaluation, logging, checkpoints
    episodes: int = option(100, "episodes to run", range=at_least(1), group=RUN, first=True)
    seed: int = option(0, "seed of the evaluation envs (env i gets seed + i)", range=SEEDS, group=RUN)
    stochastic: bool = option(False, "sample actions instead of argmax / mean action", group=RUN)


def register(subparsers: argparse._SubParsersAction) -> None:
    # gym_config imports neither torch nor gymnasium, so building the parser stays quick; the
    # trainer is imported only when the command runs.
    from ppo_rlhf.trainers.gym_config import PRESETS, GymPPOConfig

    gym = subparsers.add_parser(
        "gym", help="train PPO on a gymnasium environment (Discrete or Box actions)",
        description="Train an actor-critic with PPO on vector gymnasium envs; writes a run folder "
        "(config.yaml, metrics.jsonl, tb/, return.png, curves.png, summary.json, policy/).  The defaults "
        "listed below are the plain ones (CleanRL's); an env with a preset (CartPole-v1, Pendulum-v1) gets the "
        "preset's values instead unless --preset none.  config.yaml in the run folder shows what was used.",
    )
    gym.add_argument(
        "--preset", default="auto", choices=("auto", "none", *PRESETS),
        help="named tuned settings; 'auto' (default) picks the one for --env if there is one, 'none' uses the plain defaults",
    )
    gym.add_argument("--config", metavar="FILE.yaml", help="YAML file of config values (over the preset, under flags)")
    add_config_arguments(gym, GymPPOConfig)
    gym.set_defaults(func=run_gym)

    gym_eval = subparsers.add_parser(
        "gym-eval", help="evaluate a saved gym policy over N episodes",
        description="Run a saved policy (a run folder or its policy/ folder) and print mean/std return as JSON.",
    )
    gym_eval.add_argument("path", metavar="RUN_OR_POLICY_DIR")
    add_config_arguments(gym_eval, GymEvalConfig)
    gym_eval.set_defaults(func=run_gym_eval)


def run_gym(args: argparse.Namespace) -> int:
    from ppo_rlhf.trainers.gym_config import GymPPOConfig, config_with_preset, preset_for_env
    from ppo_rlhf.run_folder import check_out_spares_inputs
    from ppo_rlhf.trackers import check_trackers
    from ppo_rlhf.trainers.gym_ppo import train

    values = load_yaml(args.config) if args.config else {}
    if "env_id" in vars(args):  # the env decides the 'auto' preset, so look at the flag first
        values["env_id"] = args.env_id
    preset = preset_for_env(values.get("env_id", GymPPOConfig.env_id)) if args.preset == "auto" else args.preset
    config = config_from_args(GymPPOConfig, args, config_with_preset(preset or "none", values))
    check_out_spares_inputs(config, {"--config": args.config})
    check_trackers(config.report_to)  # a tracker not installed: stopped before anything loads
    print(f"ppo-rlhf gym: {config.env_id} (preset: {preset or 'none'}), {config.num_iterations} iterations of "
          f"{config.batch_size} steps -> {config.resolved_out_dir()}")
    summary = train(config)
    print(json.dumps(summary, indent=2))
    return 0


def run_gym_eval(args: argparse.Namespace) -> int:
    from ppo_rlhf.trainers.gym_ppo import evaluate_policy

    config = config_from_args(GymEvalConfig, args)
    result = evaluate_policy(args.path, config.episodes, seed=config.seed, deterministic=not config.stochastic)
    print(json.dumps(result, indent=2))
    return 0
