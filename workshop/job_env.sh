# Sourced by jupyter.sbatch and train.sbatch (bash, set -euo pipefail): who runs the job, the
# site's setup, the course environment, and a refusal to run GPU jobs on a CPU build of torch.
#
# Three places, which may be one (a single user's clone) or three (a room):
#   SHARDLAB_HOME  the course checkout holding the environment; shared and read-only in a room
#                  (default: where sbatch ran)
#   SHARDLAB_ENV   the environment to activate (default $SHARDLAB_HOME/.venv); "none" when the
#                  setup hook below already activated one (a conda environment, a module)
#   SHARDLAB_DIR   the learner's own working copy: notebooks and labs run and save here
#                  (default $SHARDLAB_HOME; workshop/seat.sh makes one per learner)
#   SHARDLAB_SETUP a bash file sourced first, for `module load python/3.11` or `conda activate`
#                  (see workshop/site.sh.example); default $SHARDLAB_HOME/workshop/site.sh if present

# USER is not exported everywhere SLURM runs jobs (`set -u` would stop the job).
SHARDLAB_USER=${USER:-$(id -un)}
SHARDLAB_HOME=${SHARDLAB_HOME:-${SLURM_SUBMIT_DIR:-$PWD}}
SHARDLAB_DIR=${SHARDLAB_DIR:-$SHARDLAB_HOME}
SHARDLAB_ENV=${SHARDLAB_ENV:-$SHARDLAB_HOME/.venv}
SHARDLAB_SETUP=${SHARDLAB_SETUP:-$SHARDLAB_HOME/workshop/site.sh}

if [ -f "$SHARDLAB_SETUP" ]; then
    # shellcheck disable=SC1090
    source "$SHARDLAB_SETUP"
fi
if [ "$SHARDLAB_ENV" != none ]; then
    if [ ! -f "$SHARDLAB_ENV/bin/activate" ]; then
        echo "error: no environment at $SHARDLAB_ENV: build it with 'make -C $SHARDLAB_HOME install'" \
             "(inside a GPU job for GPU work), or set SHARDLAB_ENV" >&2
        exit 1
    fi
    # shellcheck disable=SC1091
    source "$SHARDLAB_ENV/bin/activate"
fi
if [ ! -d "$SHARDLAB_DIR" ]; then
    echo "error: SHARDLAB_DIR=$SHARDLAB_DIR does not exist: make it with workshop/seat.sh, or unset it" >&2
    exit 1
fi
# A node with an NVIDIA GPU and an environment built where there was none: stop here, saying how
# to fix it, instead of running the GPU part on the CPU.
python "$SHARDLAB_HOME/scripts/install_torch.py" --check --home "$SHARDLAB_HOME" >/dev/null

export OMP_NUM_THREADS=1
