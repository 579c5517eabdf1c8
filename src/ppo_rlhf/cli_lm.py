"""Subcommands of the language-model pipeline: demo, sft, rm, ppo, eval, merge, serve.

Every stage takes ``--config FILE.yaml`` and a flag per config field; flags override the file.
"""

from __future__ import annotations

import argparse
import json

from ppo_rlhf.config import add_config_arguments, config_from_args
from ppo_rlhf.config_yaml import load_yaml
from ppo_rlhf.distributed import is_main_process
from ppo_rlhf.run_folder import check_out_spares_inputs
from ppo_rlhf.trackers import ReportOptions, check_trackers


def _stage(subparsers, name: str, config_cls, runner, help_text: str, printer=None):
    parser = subparsers.add_parser(name, help=help_text, description=help_text,
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", help="YAML file of config fields; flags override it")
    add_config_arguments(parser, config_cls)

    def run(args) -> int:
        yaml_values = load_yaml(args.config) if args.config else {}
        config = config_from_args(config_cls, args, yaml_values)
        check_out_spares_inputs(config, {"--config": args.config})
        if isinstance(config, ReportOptions):
            check_trackers(config.report_to)  # a tracker not installed: stopped before anything loads
        summary = runner(config)
        if is_main_process():  # several processes: one summary
            (printer or _print_summary)(summary)
        return 0

    parser.set_defaults(func=run)


def _print_summary(summary: dict) -> None:
    print(json.dumps(summary, indent=2, ensure_ascii=False))


def _print_nothing(summary: dict) -> None:
    pass


def register(subparsers) -> None:
    # Imports inside the functions keep `ppo-rlhf --help` fast.
    from ppo_rlhf.stages.demo import DemoConfig, run_demo
    from ppo_rlhf.stages.evaluate import EvalConfig, run_eval
    from ppo_rlhf.stages.merge import MergeConfig, run_merge
    from ppo_rlhf.stages.ppo import run_ppo
    from ppo_rlhf.stages.reward import run_reward
    from ppo_rlhf.stages.serve import ServeConfig, run_serve
    from ppo_rlhf.stages.sft import run_sft
    from ppo_rlhf.trainers.ppo_config import PPOConfig
    from ppo_rlhf.trainers.reward import RewardConfig
    from ppo_rlhf.trainers.sft import SFTConfig

    _stage(subparsers, "demo", DemoConfig, run_demo,
           "the whole pipeline on the built-in task: SFT -> reward model -> PPO -> evaluation", _print_nothing)
    _stage(subparsers, "sft", SFTConfig, run_sft, "supervised fine-tuning of a causal LM")
    _stage(subparsers, "rm", RewardConfig, run_reward, "train a reward model (pairwise or classification)")
    _stage(subparsers, "ppo", PPOConfig, run_ppo, "PPO from a reward model or reward function")
    _stage(subparsers, "eval", EvalConfig, run_eval, "evaluate a causal LM on held-out prompts")
    _stage(subparsers, "merge", MergeConfig, run_merge, "fold a LoRA adapter (ppo --lora, rm --lora) into a full model")
    _stage(subparsers, "serve", ServeConfig, run_serve, "a generation server on vLLM for ppo/eval --rollout-engine "
           "vllm-server and OpenAI-compatible agents (runs until stopped)", _print_nothing)
