"""Writes cli/tests/fixtures/parity/resnet_basic_lightning.pth from resnet_basic.pth: the same
state_dict as PyTorch Lightning saves it, {'state_dict': {'model.' + k: v}, 'epoch': 3, ...},
without torch (the tensors and storages are carried through as opaque pickle objects).

    python3 scripts/make_lightning_fixture.py cli/tests/fixtures/parity/resnet_basic.pth \
        cli/tests/fixtures/parity/resnet_basic_lightning.pth
"""
import pickle, sys, types, zipfile, collections

src, dst = sys.argv[1], sys.argv[2]

class Global:
    def __init__(self, module, name):
        self.module, self.name = module, name
    def __call__(self, *args):
        return Call(self, args)

class Call:
    def __init__(self, fn, args):
        self.fn, self.args = fn, args
    def __reduce__(self):
        return (fake(self.fn.module, self.fn.name), self.args)

class Storage:
    def __init__(self, pid):
        self.pid = pid

_fakes = {}
def fake(module, name):
    key = (module, name)
    if key not in _fakes:
        mod = sys.modules.get(module)
        if mod is None:
            parts = module.split('.')
            for i in range(1, len(parts) + 1):
                m = '.'.join(parts[:i])
                if m not in sys.modules:
                    sys.modules[m] = types.ModuleType(m)
            mod = sys.modules[module]
        def f(*a):
            raise RuntimeError("placeholder")
        f.__module__, f.__qualname__, f.__name__ = module, name, name
        setattr(mod, name, f)
        _fakes[key] = f
    return _fakes[key]

class Reader(pickle.Unpickler):
    def find_class(self, module, name):
        if module == 'collections' and name == 'OrderedDict':
            return collections.OrderedDict
        return Global(module, name)
    def persistent_load(self, pid):
        # ('storage', <class global>, key, location, numel): keep the class as a global ref.
        return Storage(pid)

class Writer(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, Storage):
            pid = list(obj.pid)
            if isinstance(pid[1], Global):
                pid[1] = fake(pid[1].module, pid[1].name)
            return tuple(pid)
        return None

zin = zipfile.ZipFile(src)
prefix = [n for n in zin.namelist() if n.endswith('data.pkl')][0].rsplit('/', 1)[0]
sd = Reader(zin.open(prefix + '/data.pkl')).load()
wrapped = {'state_dict': collections.OrderedDict(('model.' + k, v) for k, v in sd.items()),
           'epoch': 3, 'global_step': 30}
zout = zipfile.ZipFile(dst, 'w', zipfile.ZIP_STORED)
for n in zin.namelist():
    rel = n[len(prefix) + 1:]
    name = 'archive/' + rel
    if rel == 'data.pkl':
        import io
        buf = io.BytesIO()
        Writer(buf, protocol=2).dump(wrapped)
        zout.writestr(name, buf.getvalue())
    else:
        zout.writestr(name, zin.read(n))
zout.close()
print("wrote", dst)
