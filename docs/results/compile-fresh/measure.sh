#!/bin/bash
# usage: compile_measure.sh LABEL DYNATREE_BIN [env...]
label=$1; bin=$2; shift 2
P="Imagine you are writing a blog post comparing two popular smartphone models. Develop an outline for the blog post, including key points and subheadings to effectively compare and contrast the features, performance, and user experience of the two models. Please answer in fewer than 200 words."
D=$(mktemp -d /tmp/indfresh.XXXX)
start=$(date +%s.%N)
env "$@" TORCHINDUCTOR_CACHE_DIR=$D $bin generate "$P" --chat --method dynatree --draft ngram --compile --max-new-tokens 64 --compare ar --json $EXTRA > /tmp/cm_$label.json 2> /tmp/cm_$label.err
end=$(date +%s.%N)
echo "$label wall $(echo "$end - $start" | bc) s rc=$?"
python3 -c "
import json; rs=json.load(open('/tmp/cm_$label.json'))
for r in rs: s=r['stats']; print(r['method'], 'tok/s %.1f'%s['tokens_per_s'], 'L %.2f'%s['tokens_per_iter'], 'tpot %.1f ms'%(1e3*(s['tpot_s'] or 0)), 'compile_s', s.get('compile_s'), 'timed graphs', s.get('graphs_compiled_while_timed'), 'ttft %.0f ms'%(1e3*s['ttft_s']))
" 2>&1
