"""Talk to any checkpoint of the recipe through phalanx.inference (paged KV cache, our engine).

    python -m apps.chat_rlhf.chat --model runs/chat_rlhf/dpo              # interactive; /reset, /quit
    python -m apps.chat_rlhf.chat --model runs/chat_rlhf/dpo --prompt "Give me three tips for sleep."
    phalanx serve runs/chat_rlhf/dpo/checkpoints/step-00000012/model      # OpenAI-compatible server

`--model` takes a Hugging Face directory, a checkpoint, a training output_dir (its latest
checkpoint) or nothing (SmolLM2-135M-Instruct). The conversation is rendered with the model's own
chat template, as in training.
"""
from __future__ import annotations

import argparse
import sys


def reply(engine, tokenizer, history: list[dict], params) -> str:
    text = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return engine.generate([ids], params)[0].text.strip()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Chat with a checkpoint through phalanx.inference.")
    parser.add_argument("--model", default="", help="model dir, checkpoint or output_dir (default: SmolLM2)")
    parser.add_argument("--prompt", action="append", default=[], help="answer this and exit (repeatable: a dialogue)")
    parser.add_argument("--system", default="", help="a system message")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7, help="0 for greedy")
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from phalanx.inference import LLM, SamplingParams

    from .models import load_tokenizer, resolve_model_dir

    directory = resolve_model_dir(args.model)
    tokenizer = load_tokenizer(directory)
    engine = LLM(str(directory), tokenizer=tokenizer)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed)
    history = [{"role": "system", "content": args.system}] if args.system else []
    if args.prompt:
        for prompt in args.prompt:
            history.append({"role": "user", "content": prompt})
            answer = reply(engine, tokenizer, history, params)
            history.append({"role": "assistant", "content": answer})
            print(f"user: {prompt}\nassistant: {answer}")
        return
    print(f"chatting with {directory} (/reset clears the conversation, /quit or Ctrl-D leaves)")
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            break
        if line in ("/quit", "/exit"):
            break
        if line == "/reset":
            history = history[:1] if args.system else []
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        answer = reply(engine, tokenizer, history, params)
        history.append({"role": "assistant", "content": answer})
        print(f"bot> {answer}")


if __name__ == "__main__":
    main(sys.argv[1:])
