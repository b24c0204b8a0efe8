"""How the shipped files were made from the originals in ../shared/data/chat/ (run once; kept so
the conversion is reproducible):

    python apps/chat_rlhf/data/convert_sources.py /work/shared/data/chat

GSM8K and hh-rlhf are copied unchanged (the recipe reads them as they are). LLaMA-Factory's
sharegpt-style demo files are rewritten into TRL's formats: preference pairs as
prompt/chosen/rejected message lists, KTO rows as prompt/completion/label, alpaca rows as messages.
The text is not changed.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROLES = {"human": "user", "gpt": "assistant", "system": "system"}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"{path.relative_to(HERE)}: {len(rows)} records")


def sharegpt_turn(m: dict) -> dict:
    return {"role": ROLES[m["from"]], "content": m["value"]}


def main(src: Path) -> None:
    for name in ("gsm8k", "hh_rlhf_harmless"):
        shutil.copytree(src / name, HERE / name, dirs_exist_ok=True)
    demo, out = src / "llamafactory_demo", HERE / "llamafactory_demo"
    out.mkdir(exist_ok=True)
    shutil.copy(demo / "LICENSE", out / "LICENSE")
    pairs = json.loads((demo / "dpo_en_demo.json").read_text())
    write_jsonl(out / "dpo_en_demo.jsonl", [
        {"prompt": [sharegpt_turn(m) for m in r["conversations"]],
         "chosen": [sharegpt_turn(r["chosen"])], "rejected": [sharegpt_turn(r["rejected"])]} for r in pairs])
    kto = json.loads((demo / "kto_en_demo.json").read_text())
    write_jsonl(out / "kto_en_demo.jsonl", [
        {"prompt": r["messages"][:-1], "completion": r["messages"][-1:], "label": bool(r["label"])} for r in kto])
    alpaca = json.loads((demo / "alpaca_en_demo.json").read_text())
    write_jsonl(out / "alpaca_en_demo.jsonl", [
        {"messages": [{"role": "user", "content": r["instruction"] + (f"\n\n{r['input']}" if r.get("input") else "")},
                      {"role": "assistant", "content": r["output"]}]} for r in alpaca])


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/work/shared/data/chat"))
