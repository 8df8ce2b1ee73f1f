#!/usr/bin/env bash
# Train on one machine with composer's launcher (torch's, run in-process: --nproc).
#   NGPU=4 CONFIG=train_configs/debug_model.toml scripts/run_train.sh --training.steps 50
# NGPU: ranks to start (GPUs, or CPU processes); CONFIG: the TOML file; the
# remaining arguments are --section.key VALUE overrides.
set -euo pipefail
NGPU=${NGPU:-8}
CONFIG=${CONFIG:-train_configs/debug_model.toml}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

# Validate once, as the run would see it, so bad input gives one line and no launcher report.
WORLD_SIZE=$NGPU python -m composer.train --config "$CONFIG" --validate "$@" >/dev/null

exec python -m composer.train --nproc "$NGPU" --standalone --config "$CONFIG" "$@"
