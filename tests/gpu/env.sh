# Sourced by every script here (device tool): installs the wheels the GPU machine lacks (carried in .whl, or in the
# folder WHEELS names: flashinfer.sh's .whl-fi), puts them and the repository on the path, and stores every run of
# the call in $OUT/bench.db.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ${WHEELS:-.whl}/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD LLM_BENCH_DB=sqlite:///$OUT/bench.db
quiet() { grep -v -i -E "warn|^\s*$|^  |it/s\]" ; }  # a log without warnings, blank lines and progress bars
