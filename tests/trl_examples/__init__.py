"""Agent programs from TRL's documentation and examples, run by tests/test_agent_programs.py.

Each module keeps the program's own code as TRL shows it -- its environment classes, tools, reward
functions and data -- and changes only the trainer's lines (the import, the trainer and its
config, the model path), marked ``# TRL:`` with what they were.  TRL is Apache-2.0, (c) the
HuggingFace team; the texts come from docs/source/grpo_trainer.md ("Agent Training") and
examples/scripts/openenv/echo.py at huggingface/trl f2cd577 (the newest snapshot stored here; its
docs and examples are not in TRL 1.16's release files), and the conventions they rely on --
environment_factory's dict and its ``environment`` column, get_reward, the reward functions'
keywords, None scores -- were read in TRL 1.16.0's own source (trl/trainer/grpo_trainer.py).
"""

# What each program trains with here: a tiny budget, GRPO as TRL's trainer is.
BUDGET = dict(estimator="grpo", samples_per_prompt=2, batch_size=4, mini_batch_size=4, ppo_epochs=1, iterations=1,
              max_new_tokens=8, max_length=1024, max_turns=3, eval_every=0, save_every=0, save_rollouts=1,
              num_threads=1)
