"""TRL 1.16's GRPOTrainer with an ``environment_factory`` class, for ``benchmarks/bench_agents.py peers-env``.

Runs in its own virtual environment (`.venv-trl116`, `make trl116-venv`).  It imports the
benchmark's pure-Python environment class and reward (benchmarks/agents_tools.py, which reads
``ppo_rlhf.rewards`` from src/: the standard library and yaml only), so both systems play the same
class and score with the same check.

    .venv-trl116/bin/python benchmarks/peers/trl_env.py --settings RUN.json

``environment_factory`` is the class ``settings["environment"]`` names in agents_tools: TRL makes
one instance per concurrent episode (kept and reset from batch to batch), calls its ``reset`` with
each row's columns, and offers its public methods as the tools; the reward functions get the
instances as ``environments=``.  Everything else is as in trl_tools.py (``peers``): the
benchmark's SFT warm-up, its tokenizer given TRL's Qwen 2.5 chat template (the one TRL parses tool
calls from; ppo-rlhf's side renders with the same file) and TRL's response parser; each iteration
one generation batch (K episodes of B/K prompts) and its optimizer step, timed by a callback (wall
and process CPU seconds); the LoRA adapter saved at the end, for ppo-rlhf's ``eval`` to score on
the held-out problems as it scores its own.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # agents_tools
sys.path.insert(0, str(HERE.parents[1] / "src"))  # ppo_rlhf.rewards, for the shared check


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", required=True)
    settings = json.loads(Path(parser.parse_args().settings).read_text())

    import agents_tools
    from trl_tools import grpo_trainer, train_and_record  # this folder: the script's own, first on sys.path

    trainer, tokenizer = grpo_trainer(settings, environment_factory=getattr(agents_tools, settings["environment"]))
    train_and_record(trainer, tokenizer, Path(settings["out"]), environment=settings["environment"])


if __name__ == "__main__":
    main()
