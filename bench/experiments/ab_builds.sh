# The arguments of the A/B scripts that take prebuilt tools (prefill_ab.sh, training_ab.sh),
# sourced by them: OUT, then NAME=BINARY pairs into the arrays `names` and `bins`; ROOT (the
# repository), `note` (a line with the seconds since the start).
OUT=${1:?usage: $(basename "$0") OUT NAME=BINARY NAME=BINARY ...}; shift
(($# >= 2)) || { echo "give at least two builds" >&2; exit 2; }
mkdir -p "$OUT"
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
T0=$(date +%s)
note() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
names=()
bins=()
for spec in "$@"; do
  names+=("${spec%%=*}")
  bins+=("${spec#*=}")
  [ -x "${spec#*=}" ] || { echo "not an executable: ${spec#*=}" >&2; exit 2; }
done
