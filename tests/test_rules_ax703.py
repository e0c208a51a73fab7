"""AX703 (binary cross-entropy on a sigmoid's output) beyond its inline examples: the
fixed script trains to the same loss; models written the way public GAN and VAE code
writes them are followed, their look-alike siblings are not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from torchaxe.findings import Applicability
from torchaxe.scan.engine import ScanOptions, scan_source
from torchaxe.scan.fix import fix_source

SCRIPT = '''\
import torch
import torch.nn.functional as F

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(256, 16), (torch.rand(256, 1) > 0.5).float()
for step in range(30):
    loss = F.binary_cross_entropy(torch.sigmoid(model(x)).view(-1), y.view(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
print(loss.item())
'''

GAN = '''\
import torch
import torch.nn as nn


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(nn.Linear(8, 16), nn.ReLU(True), nn.Linear(16, 4), nn.Tanh())

    def forward(self, z):
        return self.main(z)


class Discriminator(nn.Module):
    def __init__(self, ngpu):
        super().__init__()
        self.ngpu = ngpu
        self.main = nn.Sequential(nn.Linear(4, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1), nn.Sigmoid())

    def forward(self, x):
        if x.is_cuda and self.ngpu > 1:
            out = nn.parallel.data_parallel(self.main, x, range(self.ngpu))
        else:
            out = self.main(x)
        return out.view(-1, 1).squeeze(1)


netG = Generator()
netD = Discriminator(1).to("cpu")
netD = nn.DataParallel(netD)
criterion = nn.BCELoss()
recon = nn.BCELoss()
for real in data:
    label = torch.ones(64)
    output = netD(real).view(-1)
    errD = criterion(output, label)
    fake = netG(torch.randn(64, 8))
    errR = recon((fake + 1) / 2, real)
'''


def _options(target: str = "cpu") -> ScanOptions:
    return ScanOptions(target=target, select=("AX703",))


def test_fixed_script_trains_to_the_same_loss(tmp_path):
    report = scan_source(SCRIPT, "t.py", _options())
    (finding,) = report.findings
    assert finding.line == 9 and finding.fix.applicability == Applicability.UNSAFE
    assert "binary cross-entropy on `torch.sigmoid(model(x))`" in finding.message
    result = fix_source(SCRIPT, "t.py", _options(), unsafe=True)
    assert "F.binary_cross_entropy_with_logits(model(x).view(-1), y.view(-1))" in result.fixed
    losses = {}
    for name, text in (("before", SCRIPT), ("after", result.fixed)):
        path = tmp_path / f"{name}.py"
        path.write_text(text)
        run = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        losses[name] = float(run.stdout)
    assert abs(losses["before"] - losses["after"]) <= 1e-4 * abs(losses["before"]) + 1e-6
    assert not scan_source(result.fixed, "t.py", _options()).findings


def test_a_discriminator_ending_in_sigmoid_is_followed_and_its_generator_is_not():
    report = scan_source(GAN, "gan.py", _options("cuda"))
    lines = {f.line: f for f in report.findings}
    assert set(lines) == {36}, [f.snippet for f in report.findings]
    finding = lines[36]
    assert "the output of Discriminator, whose forward() ends in a sigmoid" in finding.message
    assert "CUDA autocast refuses binary_cross_entropy" in finding.message
    assert finding.fix.applicability == Applicability.DISPLAY_ONLY and not finding.fix.edits


def test_a_name_reassigned_from_logits_to_probabilities_is_read_where_it_is_used():
    source = ('import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n'
              'class Net(nn.Module):\n    def forward(self, x):\n        x = self.fc(x)\n'
              '        x = torch.sigmoid(x)\n        return x\n'
              'class Head(nn.Module):\n    def forward(self, x):\n        x = torch.sigmoid(x)\n'
              '        x = self.fc(x)\n        return x\n'
              'net, head = Net(), Head()\n'
              'a = F.binary_cross_entropy(net(x), y)\nb = F.binary_cross_entropy(head(x), y)\n')
    lines = [f.line for f in scan_source(source, "n.py", _options()).findings]
    assert lines == [15]


def test_models_built_the_ways_public_code_builds_them_are_followed():
    source = '''\
import torch
import torch.nn as nn
import torch.nn.functional as F


def D(x):
    h = F.relu(x @ W1)
    return torch.sigmoid(h @ W2)


class Critic(nn.Module):
    def __init__(self, size, act):
        super().__init__()
        self.fc = nn.Linear(size, 1)
        self.act = act

    def forward(self, x):
        return self.act(self.fc(x))


class Scorer(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = self.build()

    def build(self):
        layers = [nn.Linear(4, 8), nn.ReLU()]
        layers.extend([nn.Linear(8, 1), nn.Sigmoid()])
        return nn.Sequential(*layers)

    def forward(self, x):
        return self.model(x)


class Trainer:
    def __init__(self):
        self.scorer = Scorer()
        self.bce = nn.BCELoss().cuda()

    def step(self, x, y):
        return self.bce(self.scorer(x), y)


net = nn.Sequential(nn.Linear(4, 1), nn.Sigmoid())
net = net.to("cuda")
critic = Critic(4, act=torch.sigmoid)
criterion = nn.BCELoss()
a = F.binary_cross_entropy(D(x), y)
b = criterion(critic(x), y)
c = criterion(net(x), y)
'''
    lines = sorted(f.line for f in scan_source(source, "m.py", _options()).findings)
    assert lines == [41, 48, 49, 50]


def test_a_sigmoid_on_one_construction_only_or_an_activation_chosen_elsewhere_is_left_alone():
    source = '''\
import torch
import torch.nn as nn


class Head(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.act = act

    def forward(self, x):
        return self.act(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        layers = [nn.Linear(4, 1), nn.Sigmoid()]
        layers.append(nn.Identity())
        self.model = nn.Sequential(*layers)

    def forward(self, x):
        return self.model(x)


criterion = nn.BCELoss()
gate = Head(torch.sigmoid)
prob = Head(nn.Identity())
net = Net()
a = criterion(prob(x), y)
b = criterion(net(x), y)
'''
    assert not scan_source(source, "m.py", _options()).findings


_DCGAN_MODEL = '''\
import torch.nn as nn
import torch.nn.functional as F


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x):
        return F.sigmoid(self.fc(x))


class Generator(nn.Module):
    def forward(self, z):
        return self.fc(z).tanh()
'''

_DCGAN_TRAIN = '''\
import torch
import torch.nn as nn
from dcgan import Discriminator, Generator

netD = Discriminator().to("cuda")
criterion = nn.BCELoss()
for x, label in data:
    output = netD(x).view(-1)
    err = criterion(output, label)
'''


def test_a_model_of_another_file_that_ends_in_a_sigmoid_is_followed_both_ways(tmp_path):
    from torchaxe.scan.engine import scan_paths

    (tmp_path / "dcgan.py").write_text(_DCGAN_MODEL)
    (tmp_path / "train.py").write_text(_DCGAN_TRAIN)
    found = sorted((Path(f.path).name, f.line) for f in scan_paths([tmp_path], _options()).findings)
    # The criterion's call in train.py, and the Discriminator's forward() in dcgan.py.
    assert found == [("dcgan.py", 10), ("train.py", 9)]
    # Alone, neither file says enough: the loss's input is another file's model, the
    # model's output is read elsewhere.
    assert scan_paths([tmp_path / "train.py"], _options()).findings == []
    assert scan_paths([tmp_path / "dcgan.py"], _options()).findings == []


def test_the_model_module_is_found_by_how_it_is_imported(tmp_path):
    from torchaxe.scan.engine import scan_paths

    package = tmp_path / "proj" / "models"
    package.mkdir(parents=True)
    (package / "gan.py").write_text(_DCGAN_MODEL)
    relative = _DCGAN_TRAIN.replace("from dcgan import", "from .models.gan import")
    (tmp_path / "proj" / "train_rel.py").write_text(relative)
    dotted = _DCGAN_TRAIN.replace("from dcgan import Discriminator, Generator", "import models.gan as g") \
                         .replace("Discriminator()", "g.Discriminator()")
    (tmp_path / "proj" / "train_abs.py").write_text(dotted)
    # A Generator (its forward ends in tanh) fed to the loss is no finding anywhere.
    (tmp_path / "proj" / "train_gen.py").write_text(_DCGAN_TRAIN.replace("from dcgan import", "from models.gan import")
                                                    .replace("Discriminator()", "Generator()"))
    # Another project's dcgan.py of the same name, whose Discriminator returns logits,
    # is not the one ``from dcgan import`` in this project reads.
    other = tmp_path / "other"
    other.mkdir()
    (other / "dcgan.py").write_text(_DCGAN_MODEL.replace("F.sigmoid(self.fc(x))", "self.fc(x)"))
    (other / "train.py").write_text(_DCGAN_TRAIN)
    found = sorted((str(Path(f.path).relative_to(tmp_path.resolve())) if Path(f.path).is_absolute()
                    else f.path, f.line) for f in scan_paths([tmp_path], _options()).findings)
    names = sorted((Path(p).name, line) for p, line in found)
    assert names == [("gan.py", 10), ("train_abs.py", 9), ("train_rel.py", 9)]


def test_a_model_a_package_re_exports_is_found_in_the_package(tmp_path):
    # U-2-Net: ``from model import U2NET``, model/__init__.py re-exporting it from
    # model/u2net.py (the __init__ says nothing of torch, and is not scanned).
    from torchaxe.scan.engine import scan_paths

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "__init__.py").write_text("from .u2net import Discriminator\n")
    (tmp_path / "model" / "u2net.py").write_text(_DCGAN_MODEL)
    (tmp_path / "train.py").write_text(_DCGAN_TRAIN.replace("from dcgan import", "from model import"))
    found = sorted((Path(f.path).name, f.line) for f in scan_paths([tmp_path], _options()).findings)
    assert found == [("train.py", 9), ("u2net.py", 10)]


def test_the_nearest_module_of_the_name_is_the_one_imported(tmp_path):
    # Two projects side by side: ``from model import D`` in b/ reads b/model/ (a
    # package re-exporting D from b/model/nets.py), not a/model.py.
    from torchaxe.scan.engine import scan_paths

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    (tmp_path / "a" / "model.py").write_text(_DCGAN_MODEL.replace("F.sigmoid(self.fc(x))", "self.fc(x)"))
    (tmp_path / "b" / "model").mkdir()
    (tmp_path / "b" / "model" / "nets.py").write_text(_DCGAN_MODEL)
    (tmp_path / "b" / "train.py").write_text(_DCGAN_TRAIN.replace("from dcgan import", "from model import"))
    found = sorted((Path(f.path).name, f.line) for f in scan_paths([tmp_path], _options()).findings)
    assert found == [("nets.py", 10), ("train.py", 9)]
