#!/bin/bash
# Seat yourself: a working copy of the course and a JupyterLab job under YOUR account, then your
# tunnel command and your URL file, once your server listens. Each learner runs it, one command,
# from their own account on the login node:
#
#   /shared/shardlab/workshop/seat.sh                    # you ($USER), with the room's settings
#   /shared/shardlab/workshop/seat.sh --until 17:15      # your server ends at 17:15 today
#   workshop/seat.sh --room /scratch/$USER -- --partition=cpu    # where your copy goes; sbatch's arguments
#
# Why your own account: the job, the tunnel (ssh as you, to a node where you have a job) and the
# URL file (~/.shardlab, readable by you only) are all the account's that runs this script. So a
# name that is not yours is refused: seated under your account, that person's JupyterLab terminal
# would be a shell as you, reading your files and every seat's token. `--shared-account NAME...`
# seats several names under your one account anyway, for a dry run or one person's several
# sessions; never hand such seats to different people (workshop/README.md, section 0).
#
# The room's settings come from workshop/seat.conf next to this script, sourced first if present
# (copy workshop/seat.conf.example): the login host, the partition, when the day ends.
# Your copy of notebooks/, labs/, docs/ and workshop/ goes to ROOM/<name> (default
# ~/shardlab-room/<name>), made once, notebooks without outputs, and kept on later runs. A later
# run reuses the job this copy submitted (its id in ROOM/<name>/.seat-job) while it is queued or
# running (no second server), else submits a new one, your work kept. GPU results are read from THIS checkout's workshop/recorded/gpu_results.json
# (the job gets SHARDLAB_GPU_RESULTS), so a run recorded after seating reaches every seat.
# Arguments after -- go to sbatch, after the room's, so they win. Your lines go to
# ROOM/<name>/SEAT.txt and to standard output.
set -euo pipefail

HOME_DIR=$(cd "$(dirname "$0")/.." && pwd)
ME=${USER:-$(id -un)}
SEAT_UNTIL=""
SEAT_ROOM=""
SEAT_SBATCH_ARGS=()
if [ -f "$HOME_DIR/workshop/seat.conf" ]; then
    # shellcheck disable=SC1091
    source "$HOME_DIR/workshop/seat.conf"
fi
ROOM=${SEAT_ROOM:-$HOME/shardlab-room}
UNTIL=$SEAT_UNTIL
WAIT=${SEAT_WAIT:-600}   # seconds to wait for every server to listen (0: submit and return)
SHARED=0
NAMES=()
SBATCH_ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --shared-account) SHARED=1; shift ;;
        --roster) grep -v '^[[:space:]]*\(#\|$\)' "$2" > /dev/null || { echo "error: $2 names nobody" >&2; exit 2; }
                  while read -r name _; do NAMES+=("$name"); done < <(grep -v '^[[:space:]]*\(#\|$\)' "$2"); shift 2 ;;
        --room) ROOM=$2; shift 2 ;;
        --until) UNTIL=$2; shift 2 ;;
        --no-wait) WAIT=0; shift ;;
        --) shift; SBATCH_ARGS=("$@"); break ;;
        -h|--help) sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "error: unknown option $1 (see --help)" >&2; exit 2 ;;
        *) NAMES+=("$1"); shift ;;
    esac
done
[ ${#NAMES[@]} -gt 0 ] || NAMES=("$ME")
for name in "${NAMES[@]}"; do
    [[ "$name" =~ ^[A-Za-z0-9._-]+$ ]] || { echo "error: '$name' is not a plain name (letters, digits, . _ -)" >&2; exit 2; }
    if [ "$name" != "$ME" ] && [ "$SHARED" = 0 ]; then
        echo "error: '$name' is not your account ($ME): each learner seats themselves, from their own account," \
             "with workshop/seat.sh. --shared-account seats other names under yours, every seat able to read" \
             "every other seat's files and tokens: for a dry run, not for a room (workshop/README.md, section 0)" >&2
        exit 2
    fi
done
[ -f "$HOME_DIR/.venv/bin/activate" ] || [ -n "${SHARDLAB_ENV:-}" ] || {
    echo "error: no environment in $HOME_DIR/.venv: run 'make install' there first" >&2; exit 1; }
# The walltime counted from now, so that a server seated at 08:40 and one seated at 09:20 both end
# with the day (a --time fixed in advance ends an early seat's server before the day does).
TIME_ARG=()
if [ -n "$UNTIL" ]; then
    end=$(date -d "$UNTIL" +%s 2>/dev/null) || { echo "error: --until '$UNTIL' is not a time (e.g. 17:15)" >&2; exit 2; }
    now=$(date +%s)
    [ "$end" -gt "$now" ] || { echo "error: --until $UNTIL has already passed today" >&2; exit 2; }
    TIME_ARG=(--time=$(( (end - now + 59) / 60 )))
fi
mkdir -p "$ROOM" || { echo "error: cannot make $ROOM: give --room a folder you may write" >&2; exit 1; }
ROOM=$(cd "$ROOM" && pwd)
# One results file for the room, the shared checkout's: gpu_check.py --record and the instructor's
# notebook 06 write it, before or after seating, and every seat's notebook 06 reads it.
RESULTS=${SHARDLAB_GPU_RESULTS:-$HOME_DIR/workshop/recorded/gpu_results.json}

# A fresh copy's notebooks start without outputs, whatever the shared checkout's files hold (an
# instructor who ran a notebook there saved its outputs and predictions into it).
clear_outputs() {
    python3 - "$@" <<'PY' || echo "warning: could not clear the notebooks' outputs in $copy (no python3?)" >&2
import json, sys
for path in sys.argv[1:]:
    try:
        nb = json.load(open(path, encoding="utf-8"))
    except (OSError, ValueError):
        continue
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "code":
            cell["outputs"], cell["execution_count"] = [], None
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
PY
}

declare -A JOB
for name in "${NAMES[@]}"; do
    copy="$ROOM/$name"
    if [ ! -d "$copy/notebooks" ]; then
        mkdir -p "$copy"
        cp -R "$HOME_DIR/notebooks" "$HOME_DIR/labs" "$HOME_DIR/docs" "$HOME_DIR/workshop" "$copy/"
        chmod -R u+w "$copy"   # the shared checkout is read-only for learners; their copy is theirs
        mapfile -t books < <(find "$copy/notebooks" "$copy/labs" -name '*.ipynb' -not -path '*/.ipynb_checkpoints/*')
        [ ${#books[@]} -eq 0 ] || clear_outputs "${books[@]}"
    fi
    # The job this copy submitted, by its id: a job of the same name seated in another room (or by
    # another run) has another working copy, and its lines would not be this copy's.
    running=""
    if [ -s "$copy/.seat-job" ]; then
        recorded=$(cat "$copy/.seat-job")
        [ -z "$(squeue -h -u "$ME" -j "$recorded" -o %T 2>/dev/null || true)" ] || running=$recorded
    fi
    if [ -n "$running" ]; then
        JOB[$name]=$running
        echo "seated $name: job $running again (queued or running already), working copy $copy"
        continue
    fi
    JOB[$name]=$(sbatch --parsable --job-name="shardlab-$name" --output="$copy/jupyter-%j.out" \
        --chdir="$copy" --export="ALL,SHARDLAB_HOME=$HOME_DIR,SHARDLAB_DIR=$copy,SHARDLAB_GPU_RESULTS=$RESULTS" \
        ${TIME_ARG[@]+"${TIME_ARG[@]}"} ${SEAT_SBATCH_ARGS[@]+"${SEAT_SBATCH_ARGS[@]}"} \
        ${SBATCH_ARGS[@]+"${SBATCH_ARGS[@]}"} "$HOME_DIR/workshop/jupyter.sbatch")
    JOB[$name]=${JOB[$name]%%;*}
    echo "${JOB[$name]}" > "$copy/.seat-job"
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
            echo "error: $name's job ${JOB[$name]} is ${state:-gone} after ${WAIT} s: see squeue, $out" \
                 "(run this again later: it waits for the same job, it does not submit another)" >&2
            failed=1; continue 2
        fi
        sleep 1
    done
    { echo "== $name (job ${JOB[$name]})"
      grep -E "ssh -N -L|ssh .* cat |scancel" "$out" | sed 's/^ *//'; } | tee "$ROOM/$name/SEAT.txt"
done
exit $failed
