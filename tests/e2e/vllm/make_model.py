"""Makes the tiny causal LM the vLLM end-to-end run serves: a Llama with random weights from a
fixed seed and a tokenizer trained here on text made from the same seed. Nothing is downloaded.

    python make_model.py OUT_DIR [--layers 2] [--seed 1234]

The folder holds what vLLM loads (config.json, model.safetensors, tokenizer files,
generation_config.json). The same arguments give the same bytes: the e2e run compares greedy
completions token for token, so the model must not change under it. A file `model.sha256`
records the weights' digest; a second run that finds the same digest leaves the folder alone.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from pathlib import Path

# Words the tokenizer is trained on and the prompts are made of (prompts.py draws from them too).
WORDS = (
    "the a of to and in is it that for on with as at by from this be are was not or but have "
    "they we you he she one all can will an more if no so up out about which when their what "
    "there time some could them other than then now only its over also after use two how "
    "our work first well way even new want any these give day most us page block cache layer "
    "token prefill decode write read memory transfer engine host device fabric counter "
    "immediate request server model prompt queue batch stream tensor kernel network link "
    "remote local region page table number value key shard rank expert weight push pull"
).split()


def corpus(seed: int, lines: int = 4000) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 24))) for _ in range(lines)]


def make_tokenizer(out: Path, seed: int, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(out)
    return fast


def make_weights(out: Path, seed: int, layers: int, vocab_size: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Larger weights than the default initialisation: the logits of a random model then have
    # clear maxima, so greedy decoding does not hinge on the last bit of a float sum. The EOS
    # row of the output layer is lowered so that completions run to max_tokens.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
        model.lm_head.weight[config.eos_token_id].fill_(0.0)
        model.lm_head.weight.mul_(4.0)
    model.save_pretrained(out, safe_serialization=True)
    # No sampling defaults from the model folder: the run asks for greedy decoding itself.
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}, indent=1) + "\n"
    )


def digest(out: Path) -> str:
    h = hashlib.sha256()
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        h.update((out / name).read_bytes())
    return h.hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--vocab", type=int, default=1024)
    args = ap.parse_args()
    out: Path = args.out
    stamp = out / "model.sha256"
    want = json.dumps({"layers": args.layers, "seed": args.seed, "vocab": args.vocab})
    if stamp.exists() and (out / "made_with.json").exists():
        if (out / "made_with.json").read_text() == want and stamp.read_text().strip() == digest(out):
            print(f"model: {out} already made ({stamp.read_text().strip()[:12]})")
            return 0
    out.mkdir(parents=True, exist_ok=True)
    make_tokenizer(out, args.seed, args.vocab)
    make_weights(out, args.seed, args.layers, args.vocab)
    (out / "made_with.json").write_text(want)
    stamp.write_text(digest(out) + "\n")
    print(f"model: {out}: {args.layers}-layer Llama, vocab {args.vocab}, seed {args.seed}, "
          f"sha256 {digest(out)[:12]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
