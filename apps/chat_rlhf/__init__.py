"""The RLHF chat recipe (ColossalChat's pipeline): SFT, reward model, DPO family, PPO, GRPO family.

    python -m apps.chat_rlhf.sft        --config apps/chat_rlhf/configs/sft.yaml
    python -m apps.chat_rlhf.train_rm   --config apps/chat_rlhf/configs/rm.yaml
    python -m apps.chat_rlhf.dpo        --config apps/chat_rlhf/configs/dpo.yaml
    python -m apps.chat_rlhf.evaluate   --config apps/chat_rlhf/configs/dpo.yaml
    python -m apps.chat_rlhf.chat       --model runs/chat_rlhf/dpo

See README.md.
"""
