"""Build mpidp's C extension, mpidp._C, with the MPI compiler wrapper.

Environment:
  MPICC            the MPI C compiler wrapper (default: `mpicc` on PATH). Build
                   against your site's MPI by putting its mpicc first on PATH.
  MPIDP_CUDA       auto (default: build the CUDA kernels when nvcc is found),
                   0 (never), 1 (always; fail without nvcc).
  MPIDP_CUDA_ARCH  semicolon-separated compute capabilities (default "80;90").
  NVCC             the CUDA compiler (default: `nvcc` on PATH).
  MPIDP_TORCH_HOOK auto (default: build the C++ modules -- the gradient hook,
                   mpidp._grad_hook, and the c10d backend, mpidp._c10d -- when
                   torch is importable here), 0 (never), 1 (always; fail
                   without torch). It is compiled against this torch and loads
                   only with the same torch version; CXX picks the compiler.
  MPIDP_BUILD_DIR  where setuptools' build/ and egg-info go (default: a directory
                   per user and source tree under the system's temp directory):
                   a build writes nothing into the source tree but the
                   extension itself, and only for `build_ext --inplace`.
"""

import copy
import glob
import hashlib
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))

# Instruction-set flags by file-name suffix. tests/c/Makefile keeps the same list.
SIMD_FLAGS = {
    "_avx2.c": ["-mavx2", "-mfma", "-mf16c"],
    "_avx512.c": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                  "-mavx512bf16", "-mfma", "-mf16c"],
}
# -ffp-contract=off: the SIMD kernels must match the scalar reference bit for bit.
C_FLAGS = ["-std=c11", "-D_GNU_SOURCE", "-O3", "-ffp-contract=off", "-Wall", "-Wextra", "-Werror",
           "-fvisibility=hidden"]


def _build_dir():
    """Out of the source tree, so that a shared or read-only checkout stays
    clean; one per tree (and user), so that rebuilds are incremental."""
    if os.environ.get("MPIDP_BUILD_DIR"):
        return os.path.abspath(os.environ["MPIDP_BUILD_DIR"])
    tree = hashlib.sha256(HERE.encode()).hexdigest()[:12]
    return os.path.join(tempfile.gettempdir(), f"mpidp-build-{os.getuid()}-{tree}")


def _rel(paths):
    return sorted(os.path.relpath(p, HERE) for p in paths)


def _mpicc():
    mpicc = os.environ.get("MPICC") or shutil.which("mpicc")
    if not mpicc:
        raise RuntimeError(
            "mpidp is built with your MPI's compiler wrapper, and no `mpicc` was "
            "found on PATH. Install Open MPI (Debian: apt-get install "
            "libopenmpi-dev openmpi-bin), load your site's MPI module, or set "
            "MPICC=/path/to/mpicc.")
    return mpicc


def _mpi4py_include():
    try:
        import mpi4py
    except ImportError as exc:
        raise RuntimeError("building mpidp needs mpi4py installed (for its C API "
                           "header): pip install mpi4py") from exc
    return mpi4py.get_include()


def _cuda_wanted():
    mode = os.environ.get("MPIDP_CUDA", "auto").strip().lower()
    if mode not in ("auto", "0", "1"):
        raise RuntimeError(f"MPIDP_CUDA must be auto, 0 or 1, not {mode!r}")
    nvcc = os.environ.get("NVCC") or shutil.which("nvcc")
    sources = glob.glob(os.path.join(HERE, "csrc/cuda/*.cu"))
    if mode == "1" and not nvcc:
        raise RuntimeError("MPIDP_CUDA=1 but no nvcc was found (set NVCC or PATH)")
    if mode == "1" and not sources:
        raise RuntimeError("MPIDP_CUDA=1 but csrc/cuda/*.cu are missing (an incomplete "
                           "source tree or sdist?): the CUDA kernels cannot be built")
    return nvcc if (mode != "0" and nvcc and sources) else None


def _cuda_home(nvcc):
    """CUDA's install directory: $CUDA_HOME, else what nvcc itself reports (nvcc
    may be a wrapper script elsewhere on PATH)."""
    if os.environ.get("CUDA_HOME"):
        return os.environ["CUDA_HOME"]
    out = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                         capture_output=True, text=True).stderr
    for line in out.splitlines():
        if line.startswith("#$ TOP="):
            return os.path.normpath(line.split("=", 1)[1].strip())
    return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))


def _torch_extensions():
    """The C++ modules built against the torch importable here -- mpidp._grad_hook
    (csrc/torch/grad_hook.cpp) and mpidp._c10d (csrc/torch/c10d_backend.cpp) --
    or none when not wanted or not possible."""
    mode = os.environ.get("MPIDP_TORCH_HOOK", "auto").strip().lower()
    if mode not in ("auto", "0", "1"):
        raise RuntimeError(f"MPIDP_TORCH_HOOK must be auto, 0 or 1, not {mode!r}")
    if mode == "0":
        return []
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as exc:
        if mode == "1":
            raise RuntimeError("MPIDP_TORCH_HOOK=1 but torch is not importable in the build "
                               "environment (pip install --no-build-isolation)") from exc
        print("mpidp: torch is not importable here: building without the C++ gradient hook "
              "and backend (DataParallel then hooks gradients from Python; the 'mpidp' "
              "backend is the Python group)")
        return []
    abi = int(torch.compiled_with_cxx11_abi())

    def extension(name, source, depends):
        return Extension(
            name,
            sources=[source],
            depends=depends,
            include_dirs=["csrc/include"],
            language="c++",
            # -isystem: torch's headers are not ours to keep free of warnings.
            # -g1 over Python's -g: line tables for backtraces, without the full
            # debug information of torch's templates (a third of the build's time).
            extra_compile_args=["-std=c++17", "-O2", "-g1", "-fvisibility=hidden", "-Wall",
                                "-Wextra", "-Werror", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
            + [f"-isystem{d}" for d in cpp_extension.include_paths()],
            library_dirs=cpp_extension.library_paths(),
            libraries=["c10", "torch", "torch_cpu", "torch_python"],
        )
    return [extension("mpidp._grad_hook", "csrc/torch/grad_hook.cpp",
                      ["csrc/py/grad_hook_api.h"]),
            extension("mpidp._c10d", "csrc/torch/c10d_backend.cpp",
                      ["csrc/py/c10d_api.h", "csrc/torch/c10d_tensors.hpp", "csrc/torch/c10d_python_work.hpp",
                       "csrc/torch/c10d_call.hpp", "csrc/torch/c10d_signature.hpp",
                       "csrc/include/mpidp/tensor.h"])]


def _cores():
    """The cores this process may run on (a batch job's share of a node)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _compile_files_in_parallel(compiler):
    """Makes compiler.compile() run its files' compiler processes on every
    core this process may use, where distutils runs them one after another
    (mpidp._C's many small C files build in 2/3 of the time on 2 cores). It
    goes through the hooks distutils' compiler classes implement
    (_setup_compile, _get_cc_args, _compile), in the order compile() itself
    calls them."""
    jobs = _cores()

    def compile(sources, output_dir=None, macros=None, include_dirs=None, debug=False,
                extra_preargs=None, extra_postargs=None, depends=None):
        macros, objects, extra_postargs, pp_opts, build = compiler._setup_compile(
            output_dir, macros, include_dirs, sources, depends, extra_postargs)
        cc_args = compiler._get_cc_args(pp_opts, debug, extra_preargs)

        def one(obj):
            src, ext = build[obj]
            compiler._compile(obj, src, ext, cc_args, extra_postargs, pp_opts)

        with ThreadPoolExecutor(max_workers=jobs) as pool:
            # list(): the first compile error is raised here, after the others end.
            list(pool.map(one, [obj for obj in objects if obj in build]))
        return objects

    compiler.compile = compile


class MpiBuildExt(build_ext):
    """build_ext that compiles and links with mpicc, adds per-file SIMD flags
    and, when CUDA is wanted, compiles csrc/cuda/*.cu with nvcc into the same
    extension (cudart linked statically, so the module imports without a GPU)."""

    def build_extensions(self):
        mpicc = _mpicc()
        cc = self.compiler
        for attr in ("compiler", "compiler_so", "linker_so"):
            cmd = getattr(cc, attr, None)
            if cmd:
                cc.set_executable(attr, [mpicc] + list(cmd[1:]))
        _compile_files_in_parallel(cc)
        nvcc = _cuda_wanted()
        for ext in self.extensions:
            if ext.language == "c++":
                continue   # the C++ hook: no MPI, no mpi4py
            ext.include_dirs.append(_mpi4py_include())
            self._add_simd_objects(ext)
            if nvcc:
                self._add_cuda(ext, nvcc)
        # The extensions build at once (each C++ one with its own compiler,
        # build_extension), and each one's files on every core.
        self.parallel = _cores()
        super().build_extensions()

    def build_extension(self, ext):
        """C++ extensions compile and link with the C++ compiler (CXX, default
        c++) instead of mpicc: they use no MPI. Each gets a copy of this
        command with a compiler of its own, as the C extension goes on
        compiling with the shared one in another thread."""
        if ext.language != "c++":
            return super().build_extension(ext)
        mine = copy.copy(self)
        mine.compiler = copy.copy(self.compiler)
        cxx = os.environ.get("CXX") or "c++"
        for attr in ("compiler_so", "compiler_so_cxx", "linker_so", "linker_so_cxx"):
            cmd = getattr(mine.compiler, attr, None)
            if cmd:
                mine.compiler.set_executable(attr, [cxx] + list(cmd[1:]))
        _compile_files_in_parallel(mine.compiler)   # bound to the copy, not to the shared one
        super(MpiBuildExt, mine).build_extension(ext)

    def _add_simd_objects(self, ext):
        """Compiles the SIMD kernel files (by suffix) with their instruction-set
        flags, through the compiler's public compile(), and links the objects
        in; every other file keeps the common flags only."""
        for suffix, flags in SIMD_FLAGS.items():
            sources = [s for s in ext.sources if s.endswith(suffix)]
            if not sources:
                continue
            ext.sources = [s for s in ext.sources if s not in sources]
            ext.extra_objects += self.compiler.compile(
                sources, output_dir=self.build_temp, macros=ext.define_macros,
                include_dirs=ext.include_dirs, extra_postargs=ext.extra_compile_args + flags,
                depends=ext.depends)

    def _add_cuda(self, ext, nvcc):
        cuda_home = _cuda_home(nvcc)
        archs = os.environ.get("MPIDP_CUDA_ARCH", "80;90").split(";")
        gencode = []
        for arch in filter(None, (a.strip() for a in archs)):
            gencode += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
        # PTX of the newest arch lets newer GPUs JIT the kernels.
        gencode += ["-gencode", f"arch=compute_{archs[-1]},code=compute_{archs[-1]}"]
        os.makedirs(self.build_temp, exist_ok=True)
        for src in glob.glob(os.path.join(HERE, "csrc/cuda/*.cu")):
            obj = os.path.join(self.build_temp, os.path.basename(src) + ".o")
            deps = [src] + glob.glob(os.path.join(HERE, "csrc/include/mpidp/*.h"))
            if not os.path.exists(obj) or any(os.path.getmtime(d) > os.path.getmtime(obj) for d in deps):
                cmd = [nvcc, "-O3", "-std=c++17", "-Xcompiler", "-fPIC,-fvisibility=hidden",
                       "-Werror", "all-warnings", "-I", os.path.join(HERE, "csrc/include"),
                       *gencode, "-c", src, "-o", obj]
                print(" ".join(cmd))
                subprocess.check_call(cmd)
            ext.extra_objects.append(obj)
        ext.define_macros.append(("MPIDP_WITH_CUDA", "1"))
        lib_dirs = [d for d in (os.path.join(cuda_home, "lib64"),
                                os.path.join(cuda_home, "targets", "x86_64-linux", "lib"),
                                os.path.join(cuda_home, "targets", "sbsa-linux", "lib"))
                    if os.path.exists(os.path.join(d, "libcudart_static.a"))]
        if not lib_dirs:
            raise RuntimeError(f"libcudart_static.a not found under {cuda_home} (set CUDA_HOME)")
        ext.extra_link_args += [f"-L{lib_dirs[0]}", "-lcudart_static", "-ldl", "-lrt",
                                "-lpthread", "-lstdc++"]


ext = Extension(
    "mpidp._C",
    sources=_rel(glob.glob(os.path.join(HERE, "csrc/core/*.c")) + glob.glob(os.path.join(HERE, "csrc/py/*.c"))),
    include_dirs=["csrc/include"],
    depends=_rel(glob.glob(os.path.join(HERE, "csrc/include/mpidp/*.h")) + glob.glob(os.path.join(HERE, "csrc/core/*.h"))
                 + glob.glob(os.path.join(HERE, "csrc/py/*.h"))),
    extra_compile_args=C_FLAGS,
    extra_link_args=["-lm"],
)

BUILD_DIR = _build_dir()
os.makedirs(BUILD_DIR, exist_ok=True)   # egg_info wants its base to exist
setup(ext_modules=[ext] + _torch_extensions(), cmdclass={"build_ext": MpiBuildExt},
      # Defaults only: a command line's --build-base or --egg-base wins.
      options={"build": {"build_base": os.path.join(BUILD_DIR, "build")},
               "egg_info": {"egg_base": BUILD_DIR}})
