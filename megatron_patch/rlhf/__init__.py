"""RLHF on megatron-core: reward model (`reward_model`), DPO (`dpo`) and GRPO (`grpo`); see README.md here."""
