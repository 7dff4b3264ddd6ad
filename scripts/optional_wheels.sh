# Sourced by the device check scripts: installs the optional kernel libraries carried as wheels
# in .whl/ (not in git; e.g. nvidia-cudnn-frontend for the packed towers' cuDNN attention, fetched
# as CONTRIBUTING.md's "Optional kernel libraries on the GPU machine" says) into /tmp/site and
# puts that on PYTHONPATH. Without .whl/ it does nothing: the code paths without them run.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} \
    && export PATH=/tmp/site/bin:$PATH  # their programs (ninja, for native_checks.py)
  echo "optional wheels: $(cd .whl && ls *.whl | tr '\n' ' ')"
fi
