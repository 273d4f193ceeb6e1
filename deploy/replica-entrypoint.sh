#!/bin/sh
# The replica images' entry point: `python -m replica "$@"`, with the C++ kernels compiled when
# the image was built ($EDGECHAT_KERNELS, one folder per kernel, named by its digest).
#
# torch loads a built extension only from a folder it may write to (its lock file, build.ninja;
# ninja then finds nothing to do), and the root filesystem may be read-only (Kubernetes:
# readOnlyRootFilesystem, ~/.cache an emptyDir). So each kernel is copied into
# $TORCH_EXTENSIONS_DIR first, a few MB, timestamps kept; one already there is left as it is.
set -eu
: "${TORCH_EXTENSIONS_DIR:=$HOME/.cache/torch_extensions}"
export TORCH_EXTENSIONS_DIR
if [ -n "${EDGECHAT_KERNELS:-}" ] && [ "$EDGECHAT_KERNELS" != "$TORCH_EXTENSIONS_DIR" ]; then
    mkdir -p "$TORCH_EXTENSIONS_DIR"
    for built in "$EDGECHAT_KERNELS"/*/; do
        dest="$TORCH_EXTENSIONS_DIR/$(basename "$built")"
        [ -e "$dest" ] && continue
        cp -R --preserve=mode,timestamps "$built" "$dest.part.$$"
        mv "$dest.part.$$" "$dest"  # whole or not at all
    done
fi
exec python -m replica "$@"
