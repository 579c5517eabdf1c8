# TRL's own code, run by tests/test_trl_scripts.py with its imports changed from trl to ppo_rlhf.trl
# and nothing else (the test restores the lines below and checks TRL's text by its sha256).
# Source: docs/source/rloo_trainer.md, "Quick start", huggingface/trl f2cd577.
# TRL is Apache-2.0, (c) the HuggingFace team (http://www.apache.org/licenses/LICENSE-2.0).
# sha256 of TRL's text: e6a8fe865d6821170071a1b790df636374b4cfcaff7b2249699f8709d8b7be2e
# TRL's import lines:
#   line 3: from trl import RLOOTrainer
#   line 4: from trl.rewards import accuracy_reward
# ---- TRL's text from here ----
# train_rloo.py
from datasets import load_dataset
from ppo_rlhf.trl import RLOOTrainer
from ppo_rlhf.trl.rewards import accuracy_reward

dataset = load_dataset("trl-lib/DeepMath-103K", split="train")

trainer = RLOOTrainer(
    model="Qwen/Qwen2-0.5B-Instruct",
    reward_funcs=accuracy_reward,
    train_dataset=dataset,
)
trainer.train()
