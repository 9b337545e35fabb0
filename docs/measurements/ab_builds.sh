# Sourced by the A/B scripts of the dated folders, with `here`, `tmp` and `start` set: builds
# $tmp/new.so (the working tree's cpu_kernels.c) and $tmp/start.so (commit $start's) as setup.py
# does, and defines `harness SRC OUT`, which builds a C harness that loads both (it links Python).
inc=$(python -c "import sysconfig; print(sysconfig.get_paths()['include'])")
libdir=$(python -c "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))")
pylib=$(python -c "import sysconfig; print('python' + sysconfig.get_config_var('LDVERSION'))")
git show "$start":hf_plookup/csrc/cpu_kernels.c > "$tmp/start.c"
for v in new start; do
  src=hf_plookup/csrc/cpu_kernels.c; [ $v = start ] && src="$tmp/start.c"
  gcc -O3 -std=c11 -ffp-contract=off -DNDEBUG -fwrapv -shared -fPIC -I"$inc" "$src" -o "$tmp/$v.so" -lpthread
done
harness() { gcc -O2 -I"$inc" "$1" -o "$2" -ldl -L"$libdir" -l"$pylib" -Wl,-rpath,"$libdir"; }
