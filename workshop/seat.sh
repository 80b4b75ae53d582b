#!/bin/bash
# Seat learners: for each one, a working copy of the course and a JupyterLab job, then each
# learner's tunnel command and URL file, once their server listens.
#
#   workshop/seat.sh --roster room.txt             # one learner per line (a name; # comments)
#   workshop/seat.sh ada grace linus               # or the names on the command line
#   workshop/seat.sh --room /scratch/room ada -- --partition=cpu --time=09:00:00
#
# Run it from the course checkout whose environment every job shares (built once with
# `make install`; learners only read it). Each learner's copy of notebooks/, labs/, docs/ and
# workshop/ goes to ROOM/<name> (default ./room), made once and kept on later runs, so a second
# run re-seats a learner without losing their work. Arguments after -- go to every sbatch.
# Every seat reads GPU results from THIS checkout's workshop/recorded/gpu_results.json (the jobs
# get SHARDLAB_GPU_RESULTS), not from its own copy: a run recorded after seating reaches every seat.
# The jobs run under the account that runs this script: a learner with their own account runs
# `workshop/seat.sh "$USER"` for themselves; an instructor seats a room of workshop accounts' names.
# Each learner's lines go to ROOM/<name>/SEAT.txt, and all of them to standard output.
set -euo pipefail

HOME_DIR=$(cd "$(dirname "$0")/.." && pwd)
ROOM=$PWD/room
WAIT=${SEAT_WAIT:-600}   # seconds to wait for every server to listen (0: submit and return)
NAMES=()
SBATCH_ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --roster) grep -v '^[[:space:]]*\(#\|$\)' "$2" > /dev/null || { echo "error: $2 names nobody" >&2; exit 2; }
                  while read -r name _; do NAMES+=("$name"); done < <(grep -v '^[[:space:]]*\(#\|$\)' "$2"); shift 2 ;;
        --room) ROOM=$(mkdir -p "$2" && cd "$2" && pwd); shift 2 ;;
        --no-wait) WAIT=0; shift ;;
        --) shift; SBATCH_ARGS=("$@"); break ;;
        -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "error: unknown option $1 (see --help)" >&2; exit 2 ;;
        *) NAMES+=("$1"); shift ;;
    esac
done
[ ${#NAMES[@]} -gt 0 ] || { echo "error: nobody to seat: give names or --roster FILE (see --help)" >&2; exit 2; }
for name in "${NAMES[@]}"; do
    [[ "$name" =~ ^[A-Za-z0-9._-]+$ ]] || { echo "error: '$name' is not a plain name (letters, digits, . _ -)" >&2; exit 2; }
done
[ -f "$HOME_DIR/.venv/bin/activate" ] || [ -n "${SHARDLAB_ENV:-}" ] || {
    echo "error: no environment in $HOME_DIR/.venv: run 'make install' there first" >&2; exit 1; }
mkdir -p "$ROOM"
# One results file for the room, the shared checkout's: gpu_check.py --record and the instructor's
# notebook 06 write it, before or after seating, and every seat's notebook 06 reads it.
RESULTS=${SHARDLAB_GPU_RESULTS:-$HOME_DIR/workshop/recorded/gpu_results.json}

declare -A JOB
for name in "${NAMES[@]}"; do
    copy="$ROOM/$name"
    if [ ! -d "$copy/notebooks" ]; then
        mkdir -p "$copy"
        cp -R "$HOME_DIR/notebooks" "$HOME_DIR/labs" "$HOME_DIR/docs" "$HOME_DIR/workshop" "$copy/"
    fi
    JOB[$name]=$(sbatch --parsable --job-name="shardlab-$name" --output="$copy/jupyter-%j.out" \
        --chdir="$copy" --export="ALL,SHARDLAB_HOME=$HOME_DIR,SHARDLAB_DIR=$copy,SHARDLAB_GPU_RESULTS=$RESULTS" \
        ${SBATCH_ARGS[@]+"${SBATCH_ARGS[@]}"} "$HOME_DIR/workshop/jupyter.sbatch")
    JOB[$name]=${JOB[$name]%%;*}
    echo "seated $name: job ${JOB[$name]}, working copy $copy"
done
[ "$WAIT" -gt 0 ] || exit 0

# Wait for each server's lines (the job prints them once its server listens), then hand them out.
failed=0
deadline=$((SECONDS + WAIT))
for name in "${NAMES[@]}"; do
    out="$ROOM/$name/jupyter-${JOB[$name]}.out"
    until [ -f "$out" ] && grep -q "ssh -N -L" "$out"; do
        state=$(squeue -h -j "${JOB[$name]}" -o %T 2>/dev/null || true)
        if [ -z "$state" ] && ! { [ -f "$out" ] && grep -q "ssh -N -L" "$out"; }; then
            echo "error: $name's job ${JOB[$name]} ended before its server listened: $out" >&2; failed=1; continue 2
        fi
        if [ $SECONDS -ge $deadline ]; then
            echo "error: $name's job ${JOB[$name]} is ${state:-gone} after ${WAIT} s: see squeue, $out" >&2; failed=1; continue 2
        fi
        sleep 1
    done
    { echo "== $name (job ${JOB[$name]})"
      grep -E "ssh -N -L|ssh .* cat |scancel" "$out" | sed 's/^ *//'; } | tee "$ROOM/$name/SEAT.txt"
done
exit $failed
