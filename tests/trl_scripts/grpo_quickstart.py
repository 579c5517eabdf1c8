# TRL's own code, run by tests/test_trl_scripts.py with its imports changed from trl to ppo_rlhf.trl
# and nothing else (the test restores the lines below and checks TRL's text by its sha256).
# Source: docs/source/grpo_trainer.md, "Quick start", huggingface/trl f2cd577.
# TRL is Apache-2.0, (c) the HuggingFace team (http://www.apache.org/licenses/LICENSE-2.0).
# sha256 of TRL's text: 191577da088dce3a9d7a5f00cadb81d2cb78f0af7c0c37dadd37ecc23bcd6906
# TRL's import lines:
#   line 3: from trl import GRPOTrainer
#   line 4: from trl.rewards import accuracy_reward
# ---- TRL's text from here ----
# train_grpo.py
from datasets import load_dataset
from ppo_rlhf.trl import GRPOTrainer
from ppo_rlhf.trl.rewards import accuracy_reward

dataset = load_dataset("trl-lib/DeepMath-103K", split="train")

trainer = GRPOTrainer(
    model="Qwen/Qwen2.5-0.5B-Instruct",
    reward_funcs=accuracy_reward,
    train_dataset=dataset,
)
trainer.train()
