# Source from a checkout's root to import that checkout without installing it (the GPU machine,
# or a second tree measured beside the installed one): radixrt, with kernels/ and frontend/ as
# radixrt.kernels and radixrt.frontend as `pip install` maps them, and the benchmarks package.
# The root itself leaves sys.path (and PYTHONSAFEPATH keeps `python -m` from adding it), so its
# top-level kernels/ never stands in for Hugging Face's `kernels`.
_radixrt_overlay=$(mktemp -d)
cp -rs "$PWD/radixrt" "$_radixrt_overlay/radixrt"
ln -s "$PWD/kernels" "$_radixrt_overlay/radixrt/kernels"
ln -s "$PWD/frontend" "$_radixrt_overlay/radixrt/frontend"
ln -s "$PWD/benchmarks" "$_radixrt_overlay/benchmarks"
_radixrt_path=$(printf '%s' "${PYTHONPATH:-}" | tr ':' '\n' | grep -vxF -e "$PWD" -e . -e '' | paste -sd:)
export PYTHONPATH=$_radixrt_overlay${_radixrt_path:+:$_radixrt_path}
export PYTHONSAFEPATH=1
unset _radixrt_path
