"""llama.cpp's greedy answer to one chat question on the embedded GGUF file (2 threads): the
process whose peak memory `rss.sh` compares with `dynatree generate`'s."""

import sys

from llama_cpp import Llama

from dynatree.embedded import EMBEDDED
from dynatree.models import _embedded_gguf

llm = Llama(model_path=str(_embedded_gguf(EMBEDDED["smollm2-135m"])), n_ctx=4096, n_threads=2, verbose=False)
out = llm.create_chat_completion([{"role": "user", "content": sys.argv[1]}], max_tokens=int(sys.argv[2]),
                                 temperature=0.0, top_k=1)
print(out["choices"][0]["message"]["content"])
