"""Agent programs from TRL's documentation, run by tests/test_agent_programs.py through ppo_rlhf.trl.

Each module keeps the program's own code as TRL shows it -- its environment classes, tools, reward
functions, data and its ``GRPOTrainer`` call -- importing from ppo_rlhf.trl instead of trl.  TRL's
snippets leave parts out ("...": a reward function's body, the model, the data set); those are
filled in and marked ``# TRL:`` with what the docs show, the model is a tiny local one, and the
run's length a test's (``BUDGET``).  TRL's complete programs run verbatim from tests/trl_scripts/
(the "Environments" example, the OpenEnv echo script).  TRL is Apache-2.0, (c) the HuggingFace
team; the texts come from docs/source/grpo_trainer.md ("Agent Training") at huggingface/trl
f2cd577, and the conventions they rely on -- environment_factory's dict and its ``environment``
column, get_reward, the reward functions' keywords, None scores -- were read in TRL 1.16.0's own
source (trl/trainer/grpo_trainer.py).
"""

# What each program trains with here: one step of 2 prompts x 2 completions, each episode's rollouts
# kept (log_completions: rollouts/iteration_0001.jsonl), room for a scripted tool call.
BUDGET = dict(max_steps=1, num_generations=2, per_device_train_batch_size=4, max_completion_length=128,
              max_tool_calling_iterations=2, log_completions=True, report_to="none", gradient_checkpointing=False)
