"""The prepared rows on disk as a map-style torch dataset, the form `phalanx.train.fit` takes."""
from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import Dataset


class TokenRows(Dataset):
    """Rows of `input_ids` / `labels` saved by prepare_data, as dicts of int64 tensors.

    A per-category DatasetDict (data.per_category_bins) is concatenated: the loop's sampler
    shuffles rows, so categories mix at the batch level.
    """

    def __init__(self, path: str | Path):
        from datasets import Dataset as HFDataset, DatasetDict, concatenate_datasets, load_from_disk

        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"no prepared data at {path}: run `python -m apps.llama.prepare_data` "
                                    "(add --sft for chat data) with the same config first")
        data = load_from_disk(str(path))
        if isinstance(data, DatasetDict):
            data = concatenate_datasets(list(data.values()))
        assert isinstance(data, HFDataset)
        missing = {"input_ids", "labels"} - set(data.column_names)
        if missing:
            raise ValueError(f"{path} lacks columns {sorted(missing)}; re-run prepare_data")
        self.data = data.with_format("numpy", columns=["input_ids", "labels"])

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = self.data[int(index)]
        return {"input_ids": torch.as_tensor(row["input_ids"], dtype=torch.long),
                "labels": torch.as_tensor(row["labels"], dtype=torch.long)}
