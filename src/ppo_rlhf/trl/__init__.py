"""TRL's trainers and configs over this project's trainer: a TRL script runs here with its import
changed (docs/migrating_from_trl.md).

    from ppo_rlhf.trl import GRPOConfig, GRPOTrainer       # was: from trl import GRPOConfig, GRPOTrainer
    from ppo_rlhf.trl import PPOConfig, PPOTrainer         # was: from trl import PPOConfig, PPOTrainer
    from ppo_rlhf.trl.utils import SIMPLE_CHAT_TEMPLATE    # was: from trl.trainer.utils import ...

``PPOConfig`` / ``PPOTrainer`` are TRL's PPO as TRL kept it until deleting it (0.23 - 0.29),
``GRPOConfig`` / ``GRPOTrainer`` and ``RLOOConfig`` / ``RLOOTrainer`` TRL 1.16's, each config a
``transformers.TrainingArguments`` with TRL's fields and defaults (configs.py).  A trainer reads
its config into this project's PPOConfig (translate.py, by the table of fields.py), refuses at
construction what has no counterpart here, and trains with this project's PPOTrainer
(trainer_base.py, ppo_trainer.py, online_trainers.py).  The script helpers ``ScriptArguments``,
``ModelConfig``, ``get_peft_config``, ``get_quantization_config`` and ``get_kbit_device_map`` are
TRL's (script_utils.py): TRL itself is not installed in this project's environment.
"""

from ppo_rlhf.trl.configs import GRPOConfig, PPOConfig, RLOOConfig
from ppo_rlhf.trl.script_utils import (ModelConfig, ScriptArguments, get_kbit_device_map, get_peft_config,
                                       get_quantization_config)
from ppo_rlhf.trl.online_trainers import GRPOTrainer, RLOOTrainer
from ppo_rlhf.trl.ppo_trainer import PPOTrainer
from ppo_rlhf.trl.utils import SIMPLE_CHAT_TEMPLATE

__all__ = ["GRPOConfig", "GRPOTrainer", "ModelConfig", "PPOConfig", "PPOTrainer", "RLOOConfig", "RLOOTrainer",
           "SIMPLE_CHAT_TEMPLATE", "ScriptArguments", "get_kbit_device_map", "get_peft_config",
           "get_quantization_config"]
