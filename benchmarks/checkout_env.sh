# Source from a checkout's root to import that checkout without installing it (the GPU machine,
# or a second tree measured beside the installed one): radixrt, with kernels/ and frontend/ as
# radixrt.kernels and radixrt.frontend as `pip install` maps them, and the benchmarks package.
_radixrt_overlay=$(mktemp -d)
cp -rs "$PWD/radixrt" "$_radixrt_overlay/radixrt"
ln -s "$PWD/kernels" "$_radixrt_overlay/radixrt/kernels"
ln -s "$PWD/frontend" "$_radixrt_overlay/radixrt/frontend"
export PYTHONPATH=$_radixrt_overlay:$PWD${PYTHONPATH:+:$PYTHONPATH}
# `python -m` would put the working directory first on sys.path, where radixrt/ lacks the
# kernels/ and frontend/ links: keep the overlay first (the root stays, after it, for benchmarks)
export PYTHONSAFEPATH=1
