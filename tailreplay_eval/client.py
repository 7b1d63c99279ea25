"""The client side of the serving benchmarks: greedy streaming `/generate` with its time to first token, and the
word documents and chat prompts the text workloads are made of (bench/shared_prefix.py, bench/workloads.py,
bench/router.py)."""

import concurrent.futures
import json
import random
import time

import requests

WORDS = ("river stone lantern harbor signal garden copper window engine meadow silver orbit ladder canyon "
         "thunder pocket marble violet anchor forest ember glacier compass falcon").split()


def document(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


DOCUMENT_QUESTIONS = ["Which word comes first?", "Which word appears most often?",
                      "Name three words that never appear.", "Summarise the document in one line.",
                      "Which word is the rarest?", "Count the words."]


def document_clients(clients: int, requests: int, system_words: int, seed: int) -> list[tuple[str, list[str]]]:
    """Per client of a multi-client trace (bench/router.py, bench/pd.py): its own prefix, a system prompt over its
    own document, and its questions."""
    return [(f"System: you are assistant {c}. Reference document: " + document(system_words, seed=seed + c),
             DOCUMENT_QUESTIONS[:requests]) for c in range(clients)]


def stream_generate(base_url: str, input_ids: list[int] | str, max_new_tokens: int, **extra) -> dict:
    """Greedy /generate with streaming: returns output ids, meta_info and time to first token. A str is sent as
    `text` (what sglang-router's cache-aware policy matches on); `extra` goes into the body (`image_data`)."""
    prompt = {"text": input_ids} if isinstance(input_ids, str) else {"input_ids": input_ids}
    body = {**prompt, **extra, "stream": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
    start, ttft, last = time.perf_counter(), None, None
    with requests.post(f"{base_url}/generate", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            ttft = ttft if ttft is not None else time.perf_counter() - start
            last = json.loads(line[5:])
    return {"output_ids": last["output_ids"], "meta_info": last["meta_info"], "ttft_s": ttft}


def chat_ids(tok, system: str, turns: list[tuple[str, str]]) -> list[int]:
    messages = [{"role": "system", "content": system}]
    for role, content in turns:
        messages.append({"role": role, "content": content})
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False).input_ids


def pd_generate(prefill_url: str, bootstrap_port: int, decode_url: str, body: dict, timeout: float = 300.0,
                room: int | None = None) -> tuple[dict, dict]:
    """One request through a PD pair without a router, as SGLang's mini load balancer sends it: the same body,
    with the prefill server's bootstrap address and a room id, posted to both servers at once. Returns both JSON
    answers (the prefill server's carries its own meta_info: its cached tokens and Tail-Replay values)."""
    room = random.randrange(1, 2**63) if room is None else room
    body = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port, "bootstrap_room": room}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = [pool.submit(requests.post, f"{url}/generate", json=body, timeout=timeout)
                   for url in (prefill_url, decode_url)]
        prefill, decode = (a.result() for a in answers)
    for r in (prefill, decode):
        r.raise_for_status()
    return prefill.json(), decode.json()
