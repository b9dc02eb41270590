# Sourced by the device scripts: sets bin to the carried binaries,
# unpacking them first where tools/pack-device.sh packed them into
# .carry/bin.tar.xz (XZ_BIN=1, to leave room in the carry).
bin=.carry/bin
[ -d $bin ] || tar -xJf .carry/bin.tar.xz -C .carry
