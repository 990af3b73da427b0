"""Token ids of Spec-Bench chat prompts (first turns, a sample, and second turns with a fixed answer) under
a converted checkpoint directory's tokenizer, as JSON: the GPU job (device.sh) compares its own conversion's
with this machine's (.gg/tok524.json, written by prepare.sh) before its answers count.
    python tokcmp.py CONVERTED_DIR > ids.json"""
import json, sys
from transformers import AutoTokenizer
from dynatree.distill.chat import chat_ids, instruction_sources
d = sys.argv[1]
tok = AutoTokenizer.from_pretrained(d)
groups, _ = instruction_sources("specbench,specbench-asks", 10)
convs = [c for g in groups for c in g][::7][:300]
out = [chat_ids(tok, c[:1], []) for c in convs] + [chat_ids(tok, c[:2], ["An answer, with\nnew lines é 漢字 ."]) for c in convs if len(c) > 1][:50]
out.append(tok.decode(out[0]))
print(json.dumps(out))
