#!/usr/bin/env bash
# Command-line tests of the msa tool, one case per ctest test:
#   cli_test.sh <case> <path to msa> <work dir>
# Each case runs msa, checks the exit code and that the output names the problem.
set -uo pipefail
case_name=$1
msa=$2
work=$3
rm -rf "$work" && mkdir -p "$work" && cd "$work" || exit 1

fail() {
  echo "FAIL [$case_name]: $*" >&2
  exit 1
}

# expect <exit code> <extended regex or ''> <command...>: runs the command, checks its exit
# code and that stdout+stderr match the pattern.
expect() {
  local want=$1 pattern=$2
  shift 2
  "$@" >stdout.txt 2>stderr.txt
  local rc=$?
  cat stdout.txt stderr.txt >all.txt
  if [[ $rc != "$want" ]]; then
    cat all.txt >&2
    fail "'$*' exited with $rc, expected $want"
  fi
  if [[ -n $pattern ]] && ! grep -qE -- "$pattern" all.txt; then
    cat all.txt >&2
    fail "'$*': output does not match /$pattern/"
  fi
  echo "ok: $* -> $rc"
}

# Writes a raw safetensors file: <file> <header json> <data bytes>; the 8-byte length is the
# header's length unless a 4th argument gives another one.
raw_file() {
  local file=$1 header=$2 data_bytes=$3 length=${4:-${#2}}
  local i escaped=""
  for ((i = 0; i < 8; i++)); do escaped+=$(printf '\\x%02x' $(((length >> (8 * i)) & 255))); done
  printf "$escaped" >"$file"
  printf '%s' "$header" >>"$file"
  head -c "$data_bytes" /dev/zero >>"$file"
}

# Like raw_file, with the data section given as printf escapes (e.g. '\x00\x00\xc0\x7f').
raw_data_file() {
  raw_file "$1" "$2" 0
  printf "$3" >>"$1"
}

# Runs `msa run-case` on an input that must be rejected: exit 2, the message, no output file.
reject() {
  local input=$1 pattern=$2
  shift 2
  rm -f rejected.safetensors
  expect 2 "$pattern" "$msa" run-case --in "$input" --out rejected.safetensors --backend cpu "$@"
  grep -q '^msa run-case: error: ' stderr.txt || fail "message lacks the 'msa run-case: error:' prefix"
  [[ ! -e rejected.safetensors ]] || fail "an output file was written for a rejected input"
  ls | grep -q '\.tmp\.' && fail "a temporary file was left behind"
  return 0
}

case $case_name in
help)
  expect 0 'Subcommands:' "$msa" --help
  cp all.txt top_help.txt
  for cmd in demo run-case bench make-case inspect compare; do
    grep -q "^  $cmd " top_help.txt || fail "--help does not list $cmd"
    expect 0 "Usage: .*msa $cmd" "$msa" $cmd --help
  done
  ;;

version)
  expect 0 '^msa [0-9]+\.[0-9]+\.[0-9]+' "$msa" --version
  ;;

usage_errors)
  expect 2 'msa: error: .*subcommand' "$msa"
  expect 2 "msa: error: unknown command 'nosuch'" "$msa" nosuch
  expect 2 'msa demo: error: .*--bogus' "$msa" demo --bogus
  expect 2 "msa demo: error: .*--backend" "$msa" demo --backend tpu
  expect 2 "msa demo: error: .*--tokens" "$msa" demo --tokens 0
  expect 2 "msa demo: error: .*--docs.*'0'" "$msa" demo --docs 5,0
  expect 2 "msa demo: error: .*--tp" "$msa" demo --tp 3
  expect 2 "msa run-case: error: .*--in" "$msa" run-case --out x.safetensors
  expect 2 "msa bench: error: .*--sizes.*'12x'" "$msa" bench --sizes 12x
  expect 2 "msa bench: error: .*--selection" "$msa" bench --selection some
  expect 2 "msa bench: error: .*no/such/dir" "$msa" bench --json no/such/dir/b.json --sizes 128
  expect 2 "msa bench: error: .*--tokens.*'12x'" "$msa" bench --tokens 12x
  expect 2 "msa bench: error: .*--tokens.*--sizes" "$msa" bench --tokens 128 --sizes 128
  expect 2 "msa bench: error: --reps: .*0" "$msa" bench --reps 0 --tokens 128
  expect 2 "msa bench: error: --repeats: .*0" "$msa" bench --repeats 0 --tokens 128
  expect 2 "msa bench: error: --out: .*no/such/dir" "$msa" bench --out no/such/dir/b.csv --tokens 128
  expect 2 "msa bench: error: --csv: .*no/such/dir" "$msa" bench --csv no/such/dir/b.csv --tokens 128
  expect 2 "msa bench: error: .*--decode.*CSV" "$msa" bench --decode --csv b.csv
  [[ ! -e b.csv ]] || fail "a refused bench wrote its CSV"
  # The decode bench's options: refused before anything is filled or timed, naming the option.
  expect 2 "msa bench: error: --queries .*\[1, 16\].*'17'" "$msa" bench --decode --backend cpu --queries 1,17
  expect 2 "msa bench: error: --queries .*'0'" "$msa" bench --decode --backend cpu --queries 0
  expect 2 "msa bench: error: --queries .*comma-separated.*'x'" "$msa" bench --decode --backend cpu --queries 2,x
  expect 2 "msa bench: error: --formats .*bf16, fp8, nvfp4.*'fp16'" "$msa" bench --decode --backend cpu --formats bf16,fp16
  expect 2 "msa bench: error: --batches .*'0'" "$msa" bench --decode --backend cpu --batches 8,0
  expect 2 "msa bench: error: --batches .*'8k'" "$msa" bench --decode --backend cpu --batches 8k
  expect 2 "msa bench: error: --contexts .*'12x'" "$msa" bench --decode --backend cpu --contexts 12x
  expect 2 "msa bench: error: --contexts .*largest --queries value \(8" "$msa" bench --decode --backend cpu --contexts 4
  expect 2 "msa bench: error: --splits: .*3" "$msa" bench --decode --backend cpu --splits 3
  expect 2 "msa bench: error: --queries applies to the decode bench" "$msa" bench --queries 4 --tokens 128
  expect 2 "msa bench: error: --splits applies to the decode bench" "$msa" bench --splits 2 --tokens 128
  expect 2 "msa bench: error: --l2: x not in \{flush,keep\}" "$msa" bench --decode --backend cpu --l2 x
  expect 2 "msa bench: error: --l2 applies to the decode bench" "$msa" bench --l2 keep --tokens 128
  expect 2 "msa bench: error: --memory applies to the training bench only" "$msa" bench --memory --decode --backend cpu
  expect 2 "msa bench: error: --memory measures CUDA device memory: it needs --backend cuda" "$msa" bench --memory --backend cpu --tokens 128
  expect 2 "msa bench: error: --tokens applies to the training bench only" "$msa" bench --decode --tokens 4096
  expect 2 "msa bench: error: --selection: alike not in" "$msa" bench --decode --selection alike
  expect 2 "msa bench: error: --json: .*no/such/dir" "$msa" bench --decode --backend cpu --json no/such/dir/d.json
  expect 2 "msa inspect: error: .*absent.safetensors: no such file" "$msa" inspect absent.safetensors
  if "$msa" --version | grep -q '(CPU backend)'; then
    expect 2 "msa demo: error: .*without the CUDA backend" "$msa" demo --backend cuda
  fi
  ;;

demo_small)
  expect 0 '^PASS' "$msa" demo --tokens 2048 --backend cpu
  grep -q 'select_blocks' stdout.txt && grep -q 'kl_backward' stdout.txt && grep -q '^decode' stdout.txt || fail "the table lacks steps"
  grep -q '1/6 select_blocks' stderr.txt || fail "no progress lines on stderr"
  ;;

demo_ranked)
  # A document longer than 16 blocks so that the indexer ranks history blocks.
  expect 0 '^PASS' "$msa" demo --docs 2300,129,1 --tp 4 --samples 16 --backend cpu
  ;;

run_case_round_trip)
  expect 0 'wrote' "$msa" make-case --out in.safetensors --docs 300,129,1 --tp 4 --grad --seed 3
  expect 0 '' "$msa" run-case --in in.safetensors --out out.safetensors --backend cpu
  expect 0 '' "$msa" inspect out.safetensors
  for want in 'topk +I32 +\[1, 430, 16\]' 'out +BF16 +\[430, 16, 128\]' 'lse +F32 +\[430, 16\]' \
              'indexer_lse +F32 +\[1, 430\]' 'dq +F32 +\[430, 16, 128\]' 'dk +F32 +\[430, 1, 128\]' \
              'dv +F32 +\[430, 1, 128\]' 'dindex_q +F32 +\[430, 1, 128\]' 'dindex_k +F32 +\[430, 1, 128\]'; do
    grep -qE "^$want " stdout.txt || { cat stdout.txt; fail "output lacks /$want/"; }
  done
  grep -qE ' 0$' <(grep -E '^(out|lse|dq|dk|dv) ' stdout.txt) || fail "non-finite values in the outputs"
  # Reproducible: a second (deterministic) run gives the same bytes.
  expect 0 '' "$msa" run-case --in in.safetensors --out again.safetensors --backend cpu --deterministic --threads 1
  expect 0 '^same' "$msa" compare out.safetensors again.safetensors --tensors topk,out,lse,indexer_lse,dq,dk,dv,dindex_q,dindex_k
  # Without grad_out only the forward outputs are written.
  expect 0 '' "$msa" make-case --out fwd.safetensors --docs 200 --tp 4
  expect 0 '' "$msa" run-case --in fwd.safetensors --out fwd_out.safetensors --backend cpu
  expect 0 '' "$msa" inspect fwd_out.safetensors
  grep -qE '^dq ' stdout.txt && fail "gradients written without grad_out"
  grep -qE '^out ' stdout.txt || fail "no out tensor"
  ;;

run_case_given_topk)
  # Feeding the selection back in (indexer skipped) reproduces the outputs; the indexer LSE is
  # then computed on the host in float64 and agrees with the library's within fp32 rounding.
  expect 0 '' "$msa" make-case --out in1.safetensors --docs 2300,1 --tp 4 --grad --seed 5
  expect 0 '' "$msa" run-case --in in1.safetensors --out out1.safetensors --backend cpu
  expect 0 '' "$msa" make-case --out in2.safetensors --docs 2300,1 --tp 4 --grad --seed 5 --topk-from out1.safetensors
  expect 0 '' "$msa" run-case --in in2.safetensors --out out2.safetensors --backend cpu
  expect 0 '^same' "$msa" compare out2.safetensors out1.safetensors --tensors topk,out,lse,dq,dk,dv
  expect 0 '^same' "$msa" compare out2.safetensors out1.safetensors --tensors indexer_lse --atol 1e-5 --rtol 1e-5
  expect 0 '^same' "$msa" compare out2.safetensors out1.safetensors --tensors dindex_q,dindex_k --atol 1e-9 --rtol 1e-2
  ;;

run_case_bad_inputs)
  reject nope.safetensors 'nope.safetensors: no such file'
  "$msa" make-case --out no_v.safetensors --tp 4 --omit v >/dev/null || fail "make-case"
  reject no_v.safetensors "has no tensor 'v'"
  "$msa" make-case --out q_f32.safetensors --tp 4 --retype q=F32 >/dev/null || fail "make-case"
  reject q_f32.safetensors "tensor 'q' must be BF16"
  "$msa" make-case --out cu_u8.safetensors --tp 4 --retype cu_seqlens_q=U8 >/dev/null || fail "make-case"
  reject cu_u8.safetensors "tensor 'cu_seqlens_q' must be I32"
  "$msa" make-case --out meta.safetensors --tp 4 --set bogus=1 >/dev/null || fail "make-case"
  reject meta.safetensors "unknown __metadata__ key 'bogus'"
  "$msa" make-case --out init.safetensors --tp 4 --set init_blocks=two >/dev/null || fail "make-case"
  reject init.safetensors "'init_blocks' must be an integer, got 'two'"
  "$msa" make-case --out temp.safetensors --tp 4 --set lse_temperature=0 >/dev/null || fail "make-case"
  reject temp.safetensors "'lse_temperature' must be finite and > 0"
  "$msa" make-case --out mode.safetensors --tp 4 --set mode=train >/dev/null || fail "make-case"
  reject mode.safetensors "'mode' must be training, decode or paged_prefill, got 'train'"
  "$msa" make-case --out forcing.safetensors --tp 4 --set init_blocks=10 --set local_blocks=10 >/dev/null || fail "make-case"
  reject forcing.safetensors "init_blocks \+ local_blocks must be <= topk"
  # A selection made for other documents.
  "$msa" make-case --out small.safetensors --docs 200 --tp 4 >/dev/null || fail "make-case"
  "$msa" run-case --in small.safetensors --out small_out.safetensors --backend cpu >/dev/null || fail "run-case"
  "$msa" make-case --out mismatch.safetensors --docs 300 --tp 4 --topk-from small_out.safetensors >/dev/null || fail "make-case"
  reject mismatch.safetensors "topk must have shape \[Hi=1, total_q=300, 16\], got I32 \[1, 200, 16\]"
  # Writing into a folder that does not exist.
  expect 2 "msa run-case: error: .*no/such/dir/out.safetensors" \
    "$msa" run-case --in small.safetensors --out no/such/dir/out.safetensors --backend cpu
  ;;

run_case_bad_files)
  raw_file tiny.safetensors '' 0 3
  head -c 5 tiny.safetensors >short.safetensors
  reject short.safetensors 'truncated: 5 bytes'
  raw_file length.safetensors '{}' 0 4096
  reject length.safetensors 'truncated: header length is 4096 bytes'
  raw_file json.safetensors '{"q": {"dtype": "BF16",' 0
  reject json.safetensors 'header is not valid JSON'
  raw_file range.safetensors '{"q":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}' 2
  reject range.safetensors "tensor 'q' data_offsets \[0, 4\] run past the end"
  raw_file overlap.safetensors \
    '{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}}' 6
  reject overlap.safetensors "tensor 'b' data_offsets \[2, 6\] overlap tensor 'a'"
  raw_file dtype.safetensors '{"q":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}}' 8
  reject dtype.safetensors "unsupported dtype 'F64'"
  raw_file unknown.safetensors '{"bogus":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}' 1
  reject unknown.safetensors "unknown tensor 'bogus'"
  "$msa" make-case --out good.safetensors --tp 4 >/dev/null || fail "make-case"
  head -c $(($(stat -c %s good.safetensors) - 100)) good.safetensors >cut.safetensors
  reject cut.safetensors 'truncated'
  mkdir folder.safetensors
  reject folder.safetensors 'is a directory'
  ;;

inference_modes)
  # The inference modes are dispatched to their own reader; whatever this build supports, an
  # input without the inference tensors is refused with a message, not a crash.
  for mode in decode paged_prefill; do
    "$msa" make-case --out $mode.safetensors --tp 4 --set mode=$mode >/dev/null || fail "make-case"
    rm -f rejected.safetensors
    "$msa" run-case --in $mode.safetensors --out rejected.safetensors --backend cpu >stdout.txt 2>stderr.txt
    rc=$?
    cat stdout.txt stderr.txt
    [[ $rc == 2 ]] || fail "mode $mode exited with $rc, expected 2"
    grep -q '^msa run-case: error: ' stderr.txt || fail "mode $mode: no error message"
    [[ ! -e rejected.safetensors ]] || fail "mode $mode wrote an output"
  done
  ;;

hostile_files)
  # Nesting that would overflow a recursive parser, in every header value, is a clean error.
  deep=$(printf '%*s' 60000 '' | tr ' ' '[')$(printf '%*s' 60000 '' | tr ' ' ']')
  tensor='"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}'
  raw_file deep_meta.safetensors "{\"__metadata__\":{\"x\":$deep},$tensor}" 1
  raw_file deep_shape.safetensors "{\"a\":{\"dtype\":\"U8\",\"shape\":$deep,\"data_offsets\":[0,1]}}" 1
  raw_file deep_offsets.safetensors "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":$deep}}" 1
  for f in deep_meta deep_shape deep_offsets; do
    reject $f.safetensors 'nests JSON arrays / objects more than 16 levels deep'
    expect 2 'more than 16 levels' "$msa" inspect $f.safetensors
    (($(wc -c <all.txt) < 400)) || fail "$f: the message echoes the value ($(wc -c <all.txt) bytes)"
  done
  # A 1,000,000-character tensor name is quoted by a short prefix only.
  long=$(printf '%*s' 1000000 '' | tr ' ' 'n')
  raw_file long_name.safetensors "{\"$long\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}" 1
  reject long_name.safetensors "unknown tensor 'nnnn.*\(1000000 characters in all\)"
  (($(wc -c <all.txt) < 600)) || fail "the long name is echoed ($(wc -c <all.txt) bytes of message)"
  # Lengths are checked against the tensors before anything is sized from them: under a 3 GB
  # address-space limit the case is refused naming cu_seqlens_q (the unchecked layout would
  # allocate 8 GB for 2^31 tokens first).
  "$msa" make-case --out huge_cu.safetensors --docs 2 --tp 4 --ints cu_seqlens_q=0,2147483647 >/dev/null || fail "make-case"
  (
    ulimit -v 3000000
    reject huge_cu.safetensors "cu_seqlens_q must end at the token count q.shape\[0\] = 2, got cu_seqlens_q\[1\] = 2147483647"
  ) || exit 1
  "$msa" make-case --out down_cu.safetensors --docs 2,2 --tp 4 --ints cu_seqlens_k=0,3,1 >/dev/null || fail "make-case"
  reject down_cu.safetensors "cu_seqlens_k must be non-decreasing, got cu_seqlens_k\[1\] = 3 > cu_seqlens_k\[2\] = 1"
  "$msa" make-case --out start_cu.safetensors --docs 4 --tp 4 --ints cu_seqlens_q=1,4 >/dev/null || fail "make-case"
  reject start_cu.safetensors "cu_seqlens_q must start at 0, got cu_seqlens_q\[0\] = 1"
  ;;

compare)
  # Symmetric, NaN-aware and with the documented per-tensor tolerances by default.
  one='\x00\x00\x80\x3f' nan='\x00\x00\xc0\x7f'  # F32 1.0 and NaN, as printf escapes
  header='{"out":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
  raw_data_file a.safetensors "$header" "$nan$one"
  raw_data_file close.safetensors "$header" "$nan"'\x1f\x85\x81\x3f'   # [NaN, 1.0119]
  raw_data_file far.safetensors "$header" "$nan"'\x00\x00\xc0\x3f'     # [NaN, 1.5]
  raw_data_file no_nan.safetensors "$header" "$one$one"
  raw_data_file extra.safetensors \
    '{"out":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"lse":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}}' \
    "$nan$one$one"
  expect 0 '^same' "$msa" compare a.safetensors a.safetensors
  expect 0 '^same \(the documented tolerance of each tensor\)' "$msa" compare a.safetensors close.safetensors
  grep -q 'atol 3.0e-02, rtol 3.0e-02' all.txt || fail "the out tolerance is not shown"
  expect 1 '^different' "$msa" compare a.safetensors far.safetensors
  expect 1 '^different' "$msa" compare a.safetensors no_nan.safetensors
  expect 1 'ONLY IN B' "$msa" compare a.safetensors extra.safetensors
  expect 1 'ONLY IN A' "$msa" compare extra.safetensors a.safetensors
  expect 1 '^different \(atol 0' "$msa" compare a.safetensors close.safetensors --atol 0
  expect 0 '^same' "$msa" compare a.safetensors far.safetensors --atol 0.6
  expect 0 'cosine similarity >= 0.99' "$msa" compare --help
  ;;

first_contact)
  # One --tp default for every command that takes it.
  for cmd in demo bench make-case; do
    expect 0 '--tp' "$msa" $cmd --help
    grep -E -- '--tp' all.txt | grep -qE '\}=1 ' || { grep -E -- '--tp' all.txt; fail "$cmd --tp does not default to 1"; }
  done
  # run-case's help lists the inference inputs as well as the training ones.
  expect 0 'grad_out' "$msa" run-case --help
  for name in k_cache v_cache index_k_cache page_table seq_lens kv_format q_len_per_req; do
    grep -q "$name" all.txt || fail "run-case --help does not mention $name"
  done
  # A one-line summary on success.
  expect 0 '' "$msa" make-case --out in.safetensors --docs 200,1 --tp 4
  expect 0 '^run-case: training, cpu, 201 tokens in 2 documents, indexer, forward; wrote 4 tensors to out.safetensors' \
    "$msa" run-case --in in.safetensors --out out.safetensors --backend cpu
  [[ $(wc -l <stdout.txt) == 1 ]] || fail "run-case printed more than one line"
  ;;

bench_small)
  expect 0 'coherent' "$msa" bench --sizes 4096 --tp 4 --repeats 1 --backend cpu --json bench.json
  grep -q 'independent' stdout.txt || fail "no independent row"
  # Progress before every step (a CPU backward of a long document takes many seconds).
  for step in 'warm-up: select_blocks' 'warm-up: backward' 'run 1/1: forward' 'run 1/1: kl_backward'; do
    grep -q "$step" stderr.txt || fail "no progress line '$step'"
  done
  grep -q '"mean_union_of_8"' bench.json || fail "bench.json lacks the union size"
  # Coherent index vectors must make neighbouring tokens agree far more than independent ones.
  read -r independent coherent < <(grep '"mean_union_of_8"' bench.json | sed 's/.*: *\([0-9.]*\).*/\1/' | tr '\n' ' ')
  awk -v i="$independent" -v c="$coherent" 'BEGIN { exit !(i > 20 && c < 0.8 * i) }' ||
    fail "union of 8: independent $independent, coherent $coherent"
  echo "union of 8: independent $independent, coherent $coherent"
  ;;

bench_files)
  # The table, CSV and JSON at a tiny size: the columns of the training benchmark, GPU-only ones
  # marked on the CPU ('-' in the table, empty in the CSV, absent from the JSON).
  expect 0 '' "$msa" bench --backend cpu --tokens 256 --tp 4 --reps 1 --selection both --out bench.csv --json bench.json
  header='^ *tokens +selection +union8 +index ms +index TF +fp8 idx +plan ms +\+alloc +fwd ms +fwd TF +bwd ms +bwd TF +bwd det +kl ms +kl TF +peak GiB +GiB +buffers$'
  grep -qE "$header" stdout.txt || fail "the table header is not /$header/"
  [[ $(sed -n '/^ *tokens/,$p' stdout.txt | grep -cE '^ *256 +(independent|coherent) ') == 2 ]] || fail "the table lacks its two rows"
  grep -qE '^ *256 +independent +[0-9.]+ +[0-9.]+ +[0-9.e-]+ +- +[0-9.]+ +- +[0-9.]+ ' stdout.txt || fail "row cells ('-' for fp8 idx and +alloc on the CPU)"
  grep -q '^wrote bench.csv$' stdout.txt && grep -q '^wrote bench.json$' stdout.txt || fail "no 'wrote' lines"
  csv_header='tokens,selection,union8,indexer_ms,plan_ms,forward_ms,backward_ms,backward_det_ms,kl_ms,forward_tflops,backward_tflops,indexer_tflops,kl_tflops,peak_gib,plan_alloc_ms,buffer_bytes,indexer_fp8_ms'
  [[ $(head -1 bench.csv) == "$csv_header" ]] || fail "CSV header: $(head -1 bench.csv)"
  [[ $(wc -l <bench.csv) == 3 ]] || fail "CSV: $(wc -l <bench.csv) lines, expected a header and 2 rows"
  awk -F, 'NR > 1 {
      if (NF != 17 || $1 != 256 || ($2 != "independent" && $2 != "coherent")) exit 1
      for (i = 3; i <= 17; ++i) {
        gpu_only = (i == 8 || i == 14 || i == 15 || i == 17)  # backward_det_ms, peak_gib, plan_alloc_ms, indexer_fp8_ms
        if (gpu_only ? $i != "" : $i !~ /^[0-9.]+(e-?[0-9]+)?$/ || $i + 0 <= 0) exit 1
      }
    }' bench.csv || { cat bench.csv; fail "CSV rows"; }
  for key in msa_version device heads repeats timing flop_convention results tokens selection mean_union_of_8 \
             indexer plan forward backward kl buffer_bytes ms useful_flops tflops_per_s; do
    grep -q "\"$key\":" bench.json || fail "bench.json lacks \"$key\""
  done
  [[ $(grep -c '"kl": {' bench.json) == 2 && $(grep -c '"useful_flops"' bench.json) == 8 ]] ||
    fail "bench.json: FLOPs for indexer, forward, backward and KL of both rows"
  for key in indexer_fp8 plan_alloc backward_deterministic device_bytes_in_use step_peak_bytes device_name; do
    grep -q "\"$key\":" bench.json && fail "bench.json has the GPU-only \"$key\" on the CPU"
  done
  ls | grep -q '\.tmp$' && fail "a temporary file was left behind"
  # --sizes and --repeats still work, and so does a run without files.
  expect 0 '^ *256 +coherent ' "$msa" bench --backend cpu --sizes 256 --tp 4 --repeats 1 --selection coherent
  ;;

bench_decode)
  # The decode bench at tiny shapes on the CPU: one table row and one JSON record per (batch,
  # context, Q, format); the copy-bandwidth shares and the CUDA-graph step are GPU only ('-' in
  # the table, absent from the JSON). Selections are independent unless --selection says.
  expect 0 '' "$msa" bench --decode --backend cpu --tp 4 --batches 1 --contexts 512,2560 --queries 1,2 \
    --formats bf16,fp8 --reps 1 --json decode.json
  header='^ *batch +context +Q +cache +selection +splits +indexer +indexer GB/s +indexer % copy +attention +attention GB/s +attention % copy +step +step GB/s +step % copy +graph step +graph % copy$'
  grep -qE "$header" stdout.txt || fail "the table header is not /$header/"
  t='[0-9.]+ (us|ms|s)'
  row="^ *1 +(512|2560) +[12] +(bf16|fp8) +independent +1 +$t +[0-9.]+ +- +$t +[0-9.]+ +- +$t +[0-9.]+ +- +- +-$"
  [[ $(grep -cE "$row" stdout.txt) == 8 ]] || fail "the table lacks its 8 rows /$row/"
  grep -qE '^ *1 +2560 +2 +fp8 +independent ' stdout.txt || fail "no row for 2560 tokens, Q 2, fp8"
  grep -q '^wrote decode.json$' stdout.txt || fail "no 'wrote' line"
  for key in msa_version bench device heads repeats timing bytes_convention splits_requested results batch context \
             queries_per_request cache selection splits pages_per_request_head rows_per_page indexer attention step us bytes \
             gb_per_s; do
    grep -q "\"$key\":" decode.json || fail "decode.json lacks \"$key\""
  done
  [[ $(grep -c '"cache":' decode.json) == 8 && $(grep -c '"gb_per_s":' decode.json) == 24 ]] ||
    fail "decode.json: 8 records of indexer, attention and step"
  grep -q '"queries_per_request": 2' decode.json && grep -q '"cache": "fp8"' decode.json || fail "decode.json lacks Q 2 / fp8"
  # One row a request (Q 1) selects each of its pages once.
  [[ $(grep -c '"rows_per_page": 1.0,' decode.json) -ge 4 ]] || fail "decode.json: rows_per_page is not 1 at Q 1"
  for key in copy_bandwidth percent_of_copy device_name step_graph; do
    grep -q "\"$key\":" decode.json && fail "decode.json has the GPU-only \"$key\" on the CPU"
  done
  ls | grep -q '\.tmp$' && fail "a temporary file was left behind"
  # NVFP4 caches and a given split count.
  expect 0 '' "$msa" bench --decode --backend cpu --tp 4 --batches 2 --contexts 3k --queries 4 --formats nvfp4 --splits 2 --reps 1
  grep -qE "^ *2 +3k +4 +nvfp4 +independent +2 +$t " stdout.txt || fail "no nvfp4 row with 2 splits"
  grep -q 'splits: --splits 2' stdout.txt || fail "the note does not name --splits"
  # Both selections: the rows of a request select alike when they share their index query (at
  # 16k tokens each row ranks 127 history pages for 15 slots, so independent rows differ); Q 1
  # has one selection, so it is timed once.
  expect 0 '' "$msa" bench --decode --backend cpu --tp 4 --batches 1 --contexts 16k --queries 1,4 --formats bf16 \
    --selection both --reps 1 --json selection.json
  [[ $(grep -cE "^ *1 +16k +[14] +bf16 +(independent|coherent) +1 +$t " stdout.txt) == 3 ]] ||
    fail "not three rows (Q 1 once, Q 4 per selection)"
  python3 - selection.json <<'PY' || fail "selection.json: coherent rows do not select alike, or independent rows do"
import json, sys
rows = {(r["queries_per_request"], r["selection"]): r["rows_per_page"] for r in json.load(open(sys.argv[1]))["results"]}
assert set(rows) == {(1, "independent"), (4, "independent"), (4, "coherent")}, rows
assert rows[(1, "independent")] == 1 and rows[(4, "coherent")] == 4 and rows[(4, "independent")] < 3, rows
PY
  ;;

bench_prefill)
  # The prefill bench over a tiny manifest on the CPU: one table row and one JSON record per
  # (case, format), production-weighted totals per stratum and overall.
  cat >cases.jsonl <<'JSON'
{"case_id":"prefill_aaaa1111bbbb2222cccc","tags":["representative"],"representative_weight":30,"stratum":"b1/t1_3/k_le_32k","count":1,"batch_size":1,"query_lens":[5],"prefix_lens":[300],"final_kv_lens":[305]}
{"case_id":"prefill_dddd3333eeee4444ffff","tags":["representative","hot"],"representative_weight":10,"stratum":"b2/t1_3/k_le_32k","count":4,"batch_size":2,"query_lens":[3,4],"prefix_lens":[2048,256],"final_kv_lens":[2051,260]}

{"case_id":"prefill_0000555566667777","tags":["hot"],"representative_weight":null,"stratum":null,"count":7,"batch_size":1,"query_lens":[2],"prefix_lens":[0],"final_kv_lens":[2]}
JSON
  expect 0 '' "$msa" bench --prefill cases.jsonl --backend cpu --tp 4 --formats bf16,fp8 --reps 1 --json prefill.json \
    --csv prefill.csv
  grep -q 'cases: representative (2 of 3 rows)' stdout.txt || fail "the selection is not reported"
  header='^case +stratum +weight +batch +queries +max kv +cache +plan ms +indexer ms +attn ms +step ms +attn TF/s +idx TF/s +idx %$'
  grep -qE "$header" stdout.txt || fail "the table header is not /$header/"
  ms='[0-9]+\.[0-9]{3}' tf='([0-9.]+|-)'
  row="^(aaaa1111 +b1/t1_3/k_le_32k +30 +1 +5 +305|dddd3333 +b2/t1_3/k_le_32k +10 +2 +7 +2051) +(bf16|fp8) +$ms +$ms +$ms +$ms +[0-9.]+ +$tf +[0-9.]+$"
  [[ $(grep -cE "$row" stdout.txt) == 4 ]] || fail "the table lacks its 4 rows /$row/"
  # Only the second case has rows that rank pages (16 pages before them).
  grep -qE '^aaaa1111 .* - +[0-9.]+$' stdout.txt || fail "the first case's indexer rate is not '-'"
  grep -qE '^dddd3333 .*bf16 .* [0-9.]+ +[0-9.]+ +[0-9.]+$' stdout.txt || fail "the second case has no indexer rate"
  total='^all +(bf16|fp8) +2 +40 +[0-9]+\.[0-9]{3} +[0-9]+\.[0-9]{3}$'
  [[ $(grep -cE "$total" stdout.txt) == 2 ]] || fail "no overall totals /$total/"
  grep -qE '^b2/t1_3/k_le_32k +fp8 +1 +10 ' stdout.txt || fail "no per-stratum total"
  grep -q '^wrote prefill.csv$' stdout.txt && grep -q '^wrote prefill.json$' stdout.txt || fail "no 'wrote' lines"
  csv_header='case_id,line,stratum,weight,chunk,prefix,stands_for,batch,total_q,max_kv,cache,plan_ms,indexer_ms,attention_ms,step_ms,attention_tflops,indexer_tflops,indexer_share,attended_pairs,attention_flops,indexer_flops'
  [[ $(head -1 prefill.csv) == "$csv_header" ]] || fail "CSV header: $(head -1 prefill.csv)"
  [[ $(wc -l <prefill.csv) == 5 ]] || fail "CSV: $(wc -l <prefill.csv) lines, expected a header and 4 rows"
  # Attended pairs, exactly (tp 4: one KV head). The first case attends every key up to each
  # row: 301 + ... + 305 = 1515. The second: rows at 2048..2050 select 15 history pages and
  # their own (1920 + 1, 2, 3 keys), rows at 256..259 every key (257 + ... + 260): 6800.
  grep -q '^prefill_aaaa1111bbbb2222cccc,1,b1/t1_3/k_le_32k,30,,,,1,5,305,bf16,.*,1515,' prefill.csv ||
    fail "CSV: the first case's attended pairs are not 1515"
  grep -q '^prefill_dddd3333eeee4444ffff,2,.*,fp8,.*,6800,' prefill.csv || fail "CSV: the second case's attended pairs are not 6800"
  for key in msa_version bench device heads repeats warmup timing flop_convention manifest results totals case_id line \
             tags stratum weight batch query_lens prefix_lens total_q max_kv cache plan indexer attention step ms \
             useful_flops tflops_per_s attended_pairs indexer_share cases weighted_ms step_ms_per_call; do
    grep -q "\"$key\":" prefill.json || fail "prefill.json lacks \"$key\""
  done
  grep -q '"bench": "prefill"' prefill.json || fail "prefill.json does not name the prefill bench"
  [[ $(grep -c '"cache":' prefill.json) == 10 ]] || fail "prefill.json: 4 results and 6 totals (2 strata + all, 2 formats)"
  ls | grep -q '\.tmp$' && fail "a temporary file was left behind"
  # Every row, by tag; a row with a null representative_weight has weight 0.
  expect 0 '' "$msa" bench --prefill cases.jsonl --backend cpu --tp 4 --reps 1 --cases all
  grep -q 'cases: all (3 of 3 rows)' stdout.txt || fail "--cases all"
  grep -qE '^00005555 +- +0 +1 +2 +2 +bf16 ' stdout.txt || fail "the hot-only row (weight 0, no stratum)"
  expect 0 '' "$msa" bench --prefill cases.jsonl --backend cpu --tp 4 --reps 1 --cases hot
  grep -q 'cases: hot (2 of 3 rows)' stdout.txt || fail "--cases hot"
  # A manifest without tags (the shape manifest's fields): every row, weighted by its count.
  printf '%s\n' \
    '{"schema_version":1,"case_id":"prefill_71ca49d3833621538e26","batch_size":1,"query_lens":[1],"prefix_lens":[0],"final_kv_lens":[1],"count":11,"metrics":{"total_q":1}}' \
    '{"batch_size":1,"query_lens":[7],"prefix_lens":[200],"final_kv_lens":[207]}' >shapes.jsonl
  expect 0 '' "$msa" bench --prefill shapes.jsonl --backend cpu --tp 4 --reps 1
  grep -q 'cases: all (2 of 2 rows, the manifest has no tags)' stdout.txt || fail "a manifest without tags"
  grep -qE '^71ca49d3 +- +11 +1 +1 +1 +bf16 ' stdout.txt || fail "the count as the weight"
  grep -qE '^line 2 +- +1 +1 +7 +207 +bf16 ' stdout.txt || fail "a row without case_id or weight"
  grep -qE '^all +bf16 +2 +12 ' stdout.txt || fail "the total weight of the shape manifest"
  # A long prompt in chunks, every second chunk's worth timed: chunks 0, 2 (each for 2) and 4.
  expect 0 '' "$msa" bench --prefill long:1280:256 --sample 2 --backend cpu --tp 4 --reps 1 --json long.json
  grep -q 'long prompt: 1280 tokens in chunks of 256 (5 chunks); 3 of 5 chunks timed (--sample 2' stdout.txt ||
    fail "the long prompt's header"
  header='^chunk +prefix +queries +stands for +cache +plan ms +indexer ms +attn ms +step ms +attn TF/s +idx TF/s +idx %$'
  grep -qE "$header" stdout.txt || fail "the long prompt's table header is not /$header/"
  for want in ' +0 +0 +256 +2 +bf16 ' ' +2 +512 +256 +2 +bf16 ' ' +4 +1024 +256 +1 +bf16 '; do
    grep -qE "^$want" stdout.txt || fail "no chunk row /$want/"
  done
  grep -q 'estimate: sum over the timed chunks of time x the chunks it stands for' stdout.txt || fail "the estimate is not explained"
  grep -qE '^bf16 +3 +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+$' stdout.txt || fail "no whole-prompt total"
  for key in long_prompt tokens chunk chunks sample chunks_timed estimate stands_for prefix estimated_ms; do
    grep -q "\"$key\":" long.json || fail "long.json lacks \"$key\""
  done
  ;;

bench_prefill_errors)
  # Refused before anything is filled or timed, naming the file, the line and the field.
  printf '%s\n' '{"batch_size":1,"query_lens":[5],"prefix_lens":[300],"final_kv_lens":[305]}' \
    '{"batch_size":1,"query_lens":[5],' >bad_json.jsonl
  printf '%s\n' '{"batch_size":1,"query_lens":[5],"prefix_lens":[300]}' \
    '{"batch_size":2,"query_lens":[5],"prefix_lens":[300,1]}' >short_list.jsonl
  printf '%s\n' '{"batch_size":1,"query_lens":[5],"prefix_lens":[300],"final_kv_lens":[306]}' >bad_kv.jsonl
  printf '%s\n' '{"batch_size":1,"query_lens":[0],"prefix_lens":[300]}' >zero_q.jsonl
  printf '%s\n' '{"query_lens":[5],"prefix_lens":[300]}' >no_batch.jsonl
  printf '%s\n' '{"batch_size":1,"query_lens":[5],"prefix_lens":[1048576]}' >too_long.jsonl
  printf '%s\n' '{"batch_size":1,"query_lens":[5],"prefix_lens":[3],"tags":["hot"]}' >tagged.jsonl
  : >empty.jsonl
  p="msa bench: error: --prefill"
  expect 2 "$p absent.jsonl: no such file" "$msa" bench --prefill absent.jsonl --backend cpu
  expect 2 "$p bad_json.jsonl: line 2 is not valid JSON" "$msa" bench --prefill bad_json.jsonl --backend cpu
  expect 2 "$p short_list.jsonl: line 2: query_lens must have batch_size = 2 entries, got 1" \
    "$msa" bench --prefill short_list.jsonl --backend cpu
  expect 2 "$p bad_kv.jsonl: line 1: final_kv_lens\[0\] = 306 must equal prefix_lens\[0\] \+ query_lens\[0\] = 305" \
    "$msa" bench --prefill bad_kv.jsonl --backend cpu
  expect 2 "$p zero_q.jsonl: line 1: query_lens\[0\] must be in \[1, 1048576\], got 0" \
    "$msa" bench --prefill zero_q.jsonl --backend cpu
  expect 2 "$p no_batch.jsonl: line 1: field 'batch_size' is missing" "$msa" bench --prefill no_batch.jsonl --backend cpu
  expect 2 "$p too_long.jsonl: line 1: .* = 1048581 exceeds 1048576 tokens" "$msa" bench --prefill too_long.jsonl --backend cpu
  expect 2 "$p empty.jsonl: the manifest has no rows" "$msa" bench --prefill empty.jsonl --backend cpu
  expect 2 "msa bench: error: --cases representative: no row of tagged.jsonl is tagged 'representative' \(its tags: hot\)" \
    "$msa" bench --prefill tagged.jsonl --backend cpu
  expect 2 "msa bench: error: --formats .*bf16, fp8, nvfp4.*'fp16'" \
    "$msa" bench --prefill tagged.jsonl --cases hot --formats bf16,fp16 --backend cpu
  expect 2 "msa bench: error: --prefill and --decode are two different benches" "$msa" bench --prefill tagged.jsonl --decode
  expect 2 "msa bench: error: --tokens applies to the training bench only; --prefill" "$msa" bench --prefill tagged.jsonl --tokens 4k
  expect 2 "msa bench: error: --selection applies to the training bench only" \
    "$msa" bench --prefill tagged.jsonl --selection coherent
  expect 2 "msa bench: error: --queries applies to the decode bench" "$msa" bench --prefill tagged.jsonl --queries 2
  expect 2 "msa bench: error: --cases applies to the prefill bench \(--prefill\) only" "$msa" bench --cases all --tokens 128
  expect 2 "msa bench: error: --sample applies to the prefill bench" "$msa" bench --decode --sample 2
  expect 2 "msa bench: error: --formats applies to the decode and prefill benches" "$msa" bench --formats fp8 --tokens 128
  expect 2 "msa bench: error: --sample applies to a long prompt" "$msa" bench --prefill tagged.jsonl --cases hot --sample 2
  expect 2 "msa bench: error: --cases selects manifest rows" "$msa" bench --prefill long:4k:1k --cases all
  expect 2 "msa bench: error: --prefill long:N:C .* must have two token counts" "$msa" bench --prefill long:4k --backend cpu
  expect 2 "msa bench: error: --prefill long:N:C .*: N must be in \[1, 1048576\]" "$msa" bench --prefill long:2m:16k --backend cpu
  expect 2 "msa bench: error: --prefill long:N:C .*: C must be a token count .*'x'" "$msa" bench --prefill long:4k:x --backend cpu
  expect 2 "msa bench: error: --json: .*no/such/dir" "$msa" bench --prefill tagged.jsonl --json no/such/dir/p.json
  ls | grep -qE '\.(json|csv)$' && fail "a refused bench wrote a file"
  ;;

*)
  fail "unknown case"
  ;;
esac
echo "PASS [$case_name]"
