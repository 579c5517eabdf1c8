"""Gym PPO benchmark: ppo-rlhf against Stable-Baselines3 PPO, same settings, same machine.

    python benchmarks/bench_gym.py                      # the full benchmark (~25 min on one core)
    python benchmarks/bench_gym.py --seeds 1 --pendulum-seeds 1 --out /tmp/bench   # a quick look

CartPole-v1: the RL Zoo's tuned settings (our 'cartpole' preset), 100k env steps, per seed the mean
return of the greedy policy over 100 evaluation episodes; target >= 475 for every seed.  SB3's PPO
runs the same settings (its vf_coef 0.5 = our 1.0, since our value loss carries a 0.5 factor) for
the same number of env steps; wall time of the training loop of each, both on one torch thread.
Pendulum-v1: our 'pendulum' preset (state-independent log-std instead of the zoo's gSDE, so lr 3e-4
instead of 1e-3), 200k steps; target mean return above -400.  SB3 runs the same settings (also without gSDE) for reference.

Writes RESULTS/gym.md and RESULTS/gym.json; run folders go to --runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from ppo_rlhf.config import build_config
from ppo_rlhf.trainers.gym_config import GymPPOConfig, config_with_preset
from ppo_rlhf.trainers.gym_ppo import train

from common import command, write_results

EVAL_SEED_OFFSET = 10_000  # evaluation envs never replay a training seed (train() uses the same offset)


def run_ours(preset: str, seed: int, total_steps: int, eval_episodes: int, runs: Path) -> dict:
    config = build_config(GymPPOConfig, config_with_preset(preset, {
        "seed": seed, "total_steps": total_steps, "eval_episodes": eval_episodes,
        "out_dir": str(runs / f"{preset}-seed{seed}"),
    }))
    summary = train(config)
    return {"eval_mean_return": summary["eval_mean_return"], "eval_std_return": summary["eval_std_return"],
            "train_time_s": summary["train_time_s"], "env_steps": summary["env_steps"]}


def run_sb3(preset: str, seed: int, total_steps: int, eval_episodes: int) -> dict:
    """SB3 PPO with the settings of our preset, translated to SB3's names."""
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.evaluation import evaluate_policy
    from stable_baselines3.common.vec_env import VecNormalize

    config = build_config(GymPPOConfig, config_with_preset(preset, {"seed": seed, "total_steps": total_steps}))
    env = make_vec_env(config.env_id, n_envs=config.num_envs, seed=seed)
    if config.norm_obs or config.norm_reward:
        env = VecNormalize(env, norm_obs=config.norm_obs, norm_reward=config.norm_reward, gamma=config.gamma)

    def schedule(value: float, anneal: bool):
        return (lambda progress_remaining: progress_remaining * value) if anneal else value

    model = PPO(
        "MlpPolicy", env, n_steps=config.num_steps, batch_size=config.mini_batch_size, n_epochs=config.ppo_epochs,
        gamma=config.gamma, gae_lambda=config.lam, ent_coef=config.entropy_coef,
        vf_coef=config.vf_coef / 2,  # SB3's value loss is the plain MSE, ours 0.5 * MSE
        max_grad_norm=config.max_grad_norm, clip_range_vf=config.cliprange_value,
        learning_rate=schedule(config.lr, config.anneal_lr), clip_range=schedule(config.clip_ratio, config.anneal_clip),
        # Our network: separate tanh MLPs for actor and critic, orthogonal init (SB3's default too).
        policy_kwargs={"net_arch": {"pi": config.hidden_sizes, "vf": config.hidden_sizes},
                       "activation_fn": torch.nn.Tanh, "log_std_init": config.log_std_init},
        seed=seed, device="cpu", verbose=0,
    )
    start = time.perf_counter()
    model.learn(total_timesteps=config.num_iterations * config.batch_size)  # exactly our env steps
    train_time = time.perf_counter() - start

    eval_env = make_vec_env(config.env_id, n_envs=1, seed=seed + EVAL_SEED_OFFSET)
    if isinstance(env, VecNormalize):
        eval_env = VecNormalize(eval_env, training=False, norm_obs=config.norm_obs, norm_reward=False)
        eval_env.obs_rms = env.obs_rms
    returns, _ = evaluate_policy(model, eval_env, n_eval_episodes=eval_episodes, deterministic=True,
                                 return_episode_rewards=True)
    return {"eval_mean_return": float(statistics.mean(returns)), "eval_std_return": float(statistics.pstdev(returns)),
            "train_time_s": round(train_time, 3), "env_steps": int(model.num_timesteps)}


def benchmark(preset: str, seeds: list[int], total_steps: int, eval_episodes: int, runs: Path) -> dict:
    rows = []
    for i, seed in enumerate(seeds):
        # Alternate who goes first, so a slow spell on the shared machine hits both sides.
        order = ["ours", "sb3"] if i % 2 == 0 else ["sb3", "ours"]
        row = {"seed": seed}
        for who in order:
            row[who] = (run_ours(preset, seed, total_steps, eval_episodes, runs) if who == "ours"
                        else run_sb3(preset, seed, total_steps, eval_episodes))
            print(f"[{preset}] seed {seed} {who}: {json.dumps(row[who])}", flush=True)
        rows.append(row)
    summary = {f"{who}_{key}": value for who in ("ours", "sb3") for key, value in (
        ("mean_return", statistics.mean(r[who]["eval_mean_return"] for r in rows)),
        ("train_time_s", sum(r[who]["train_time_s"] for r in rows)))}
    summary["time_ratio_ours_over_sb3"] = summary["ours_train_time_s"] / summary["sb3_train_time_s"]
    return {"preset": preset, "total_steps": total_steps, "eval_episodes": eval_episodes, "runs": rows,
            "summary": summary}


def seed_row(row: dict) -> str:
    """One table row: a seed's return and training time for both libraries, and their ratio."""
    o, s = row["ours"], row["sb3"]
    return (f"| {row['seed']} | {o['eval_mean_return']:.1f} ± {o['eval_std_return']:.1f} | "
            f"{s['eval_mean_return']:.1f} ± {s['eval_std_return']:.1f} | {o['train_time_s']:.1f} | "
            f"{s['train_time_s']:.1f} | {o['train_time_s'] / s['train_time_s']:.2f} |")


def section(name: str, benchmark: dict, rollouts: str, target: str, sb3: str, ratio: str) -> list[str]:
    """An environment's heading and its table of seeds."""
    return [f"## {name}, {benchmark['total_steps']:,} env steps budget, {benchmark['runs'][0]['ours']['env_steps']:,} "
            f"used (whole rollouts of {rollouts}) (target: {target})", "",
            f"| seed | ppo-rlhf return | {sb3} | ppo-rlhf time (s) | SB3 time (s) | {ratio} |", "|---|---|---|---|---|---|",
            *[seed_row(row) for row in benchmark["runs"]]]


def markdown(results: dict) -> str:
    cp, pd, m = results["cartpole"], results["pendulum"], results["machine"]
    lines = [
        "# Gym PPO benchmark: ppo-rlhf vs Stable-Baselines3",
        "",
        f"Produced by: `{results['command']}`  ",
        f"Date: {results['date']}; machine: {m['cpu']}, {m['cores']} cores shared with other work "
        f"(load average {m['load_before']} before, {m['load_after']} after); one torch thread for both; "
        f"torch {m['torch']}, gymnasium {m['gymnasium']}, stable-baselines3 {m['sb3']}, Python {m['python']}.",
        "",
        "Settings: the RL Baselines3 Zoo's tuned PPO hyperparameters (our presets, `configs/gym/*.yaml`); SB3 gets the "
        "same values (its `vf_coef` is half ours because our value loss carries a 0.5 factor), the same network "
        "(separate 64-64 tanh actor and critic) and exactly the same number of env steps. Returns: greedy "
        f"(argmax / mean action) policy, mean over {cp['eval_episodes']} evaluation episodes per seed, on env seeds "
        f"the training never used. Wall time: the training loop only (rollouts + updates + logging), not evaluation.",
        "",
        *section("CartPole-v1", cp, "8 x 32", ">= 475 for every seed", "SB3 return", "time ratio ppo-rlhf / SB3"),
    ]
    sc = cp["summary"]
    passed = sum(r["ours"]["eval_mean_return"] >= 475 for r in cp["runs"])
    lines += [
        f"| **all** | **{sc['ours_mean_return']:.1f}** | **{sc['sb3_mean_return']:.1f}** | "
        f"**{sc['ours_train_time_s']:.1f}** | **{sc['sb3_train_time_s']:.1f}** | "
        f"**{sc['time_ratio_ours_over_sb3']:.2f}** |",
        "",
        f"ppo-rlhf reaches >= 475 on **{passed} of {len(cp['runs'])}** seeds.",
        "",
        *section("Pendulum-v1", pd, "4 x 1024", "mean return above -400", "SB3 return (same settings, no gSDE)", "ratio"),
    ]
    ps = pd["summary"]
    passed = sum(r["ours"]["eval_mean_return"] > -400 for r in pd["runs"])
    lines += [
        "",
        f"ppo-rlhf mean over seeds: **{ps['ours_mean_return']:.1f}**; above -400 on **{passed} of "
        f"{len(pd['runs'])}** seeds. SB3 mean: {ps['sb3_mean_return']:.1f}, above -400 on "
        f"{sum(r['sb3']['eval_mean_return'] > -400 for r in pd['runs'])} of {len(pd['runs'])}. Total training "
        f"time {ps['ours_train_time_s']:.1f} s vs {ps['sb3_train_time_s']:.1f} s, ratio "
        f"**{ps['time_ratio_ours_over_sb3']:.2f}**. How the Pendulum preset was chosen: docs/benchmarks.md, "
        "\"Classic PPO against Stable-Baselines3\".",
        "",
        "Run folders (metrics.jsonl, TensorBoard, return.png, saved policy) are written under "
        f"`{results['runs_dir']}`; re-score a policy with `ppo-rlhf gym-eval {results['runs_dir']}/cartpole-seed1 --episodes 100`.",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5], help="CartPole seeds")
    parser.add_argument("--pendulum-seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--cartpole-steps", type=int, default=100_000)
    parser.add_argument("--pendulum-steps", type=int, default=200_000)
    parser.add_argument("--eval-episodes", type=int, default=100)
    parser.add_argument("--out", default="benchmarks/results", help="folder for gym.md and gym.json")
    parser.add_argument("--runs", default="runs/bench_gym", help="folder for the run folders")
    parser.add_argument("--render-only", action="store_true",
                        help="only redraw OUT/gym.md from the measurements in OUT/gym.json (no training)")
    args = parser.parse_args()
    if args.render_only:
        results = json.loads((Path(args.out) / "gym.json").read_text())
        write_results("gym", results, markdown(results), args.out)
        return 0

    torch.set_num_threads(1)  # both sides: tiny MLPs, one thread is fastest and fair
    runs = Path(args.runs)
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    results = {
        "command": command(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "runs_dir": str(runs),
        "cartpole": benchmark("cartpole", args.seeds, args.cartpole_steps, args.eval_episodes, runs),
        "pendulum": benchmark("pendulum", args.pendulum_seeds, args.pendulum_steps, args.eval_episodes, runs),
    }
    import gymnasium
    import stable_baselines3

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    results["machine"] = {
        "cpu": cpu, "cores": os.cpu_count(), "load_before": load_before,
        "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg()), "torch": torch.__version__,
        "gymnasium": gymnasium.__version__, "sb3": stable_baselines3.__version__, "python": platform.python_version(),
    }
    write_results("gym", results, markdown(results), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
