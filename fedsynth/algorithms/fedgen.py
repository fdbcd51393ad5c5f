"""FedGen (Zhu, Hong, Zhou, ICML 2021; the authors' code: zhuangdizhu/FedGen, userpFedGen.py / serverpFedGen.py).

The server keeps a conditional generator G(eps, y) in the model's feature space (fedsynth.learning.fedgen_generator) and,
after each round's FedAvg, trains it against the received clients' heads weighted per class by their label counts
(coordinator.fedgen_server). Its weights, the global label distribution and the round's regularizer scale are the
server state and travel to the clients as the task's "extra" group. A client adds the authors' two regularizers to
its cross-entropy from round 2 on (the authors' `regularization = glob_iter > 0`):

  loss = CE(f(x), y) + a * CE(head(G(y_s)), y_s) + b * KL(softmax(head(G(y))) || softmax(f(x)))

with y_s drawn from the global label distribution (the authors draw uniformly among the labels present), and
a = max(1e-4, alpha * decay^(r-1)), b likewise with beta (the authors' exp_lr_decay of generative_alpha/beta).

Defaults: the authors' (utils/model_config.py RUNCONFIGS) except alpha and beta. The authors use alpha = beta = 10
with local SGD at lr 0.01 without momentum; under fedsynth's default local SGD (lr 0.05, momentum 0.9: a ~50x
larger effective step) alpha = beta = 10 blew the model up in round 2 on digits (measured: NaN updates, dead ReLU
features), so the defaults are alpha = beta = 1. For the authors' setting pass alpha = beta = 10 with train.lr =
0.01 and train.momentum = 0. Decay 0.98; server: gen_steps 50 Adam steps per round (ensemble_epochs 50 / n_teacher_iters 5, 5 iterations each),
gen_batch_size 128 (ensemble_batch_size), gen_lr 3e-4 (ensemble_lr); noise_dim 32 and hidden_dim 256.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fedsynth.algorithms.base import Aggregator, ClientUpdate, StateDict, check_parameters, snapshot_state
from fedsynth.errors import WireError
from fedsynth.learning.fedgen_generator import FeatureGenerator
from fedsynth.learning.training import LocalTrainConfig, TrainData, run_local_sgd, train_device

HEAD_PREFIXES = ("classifier.", "net.fc.")  # fedsynth.learning.models: SmallCNN's head, CifarResNet18's head
GEN = "generator."
MIN_SCALE = 1e-4


def head_prefix(state: StateDict) -> str:
    for prefix in HEAD_PREFIXES:
        if f"{prefix}weight" in state:
            return prefix
    raise WireError(f"fedgen: the model has no head among {HEAD_PREFIXES}")


def head_keys(state: StateDict) -> list[str]:
    """The state keys of the head's weight and bias."""
    prefix = head_prefix(state)
    return [f"{prefix}weight", f"{prefix}bias"]


def head_of(state: StateDict) -> StateDict:
    """The head's weight and bias of a model state (what the server keeps of each client's update)."""
    weight, bias = head_keys(state)
    return {"weight": state[weight].detach().clone(), "bias": state[bias].detach().clone()}


def generator_from(state: StateDict) -> FeatureGenerator:
    """The generator whose weights the "generator." keys of a server state hold, in eval mode."""
    weights = {k.removeprefix(GEN): v for k, v in state.items() if k.startswith(GEN)}
    try:
        hidden, num_classes_plus_noise = weights["hidden.0.weight"].shape
        feature_dim = weights["output.weight"].shape[0]
        num_classes = int(state["label_distribution"].numel())
        generator = FeatureGenerator(num_classes=num_classes, feature_dim=feature_dim,
                                     noise_dim=num_classes_plus_noise - num_classes, hidden_dim=hidden)
        generator.load_state_dict(weights)
    except (KeyError, ValueError, RuntimeError) as exc:
        raise WireError(f"fedgen: the generator in the task does not fit its layout ({str(exc)[:200]})") from exc
    return generator.eval()


@dataclass(frozen=True)
class FedGen:
    alpha: float = 1.0
    beta: float = 1.0
    decay: float = 0.98
    gen_steps: int = 50
    gen_batch_size: int = 128
    gen_lr: float = 3e-4

    name = "fedgen"
    noise_dim = 32
    hidden_dim = 256

    def __post_init__(self) -> None:
        check_parameters(self)

    # ---- server ----------------------------------------------------------------------------------

    def initial_server_state(self, global_state: StateDict) -> StateDict:
        weight = global_state[f"{head_prefix(global_state)}weight"]
        num_classes, feature_dim = weight.shape
        with torch.random.fork_rng():
            torch.manual_seed(0)
            generator = FeatureGenerator(num_classes=num_classes, feature_dim=feature_dim, noise_dim=self.noise_dim,
                                         hidden_dim=self.hidden_dim)
        state = {f"{GEN}{k}": v.detach().clone() for k, v in generator.state_dict().items()}
        state["label_distribution"] = torch.full((num_classes,), 1.0 / num_classes)
        state["reg_scale"] = torch.zeros(())  # round 1: no regularizer (the generator has not been trained)
        return state

    def server_extra(self, server_state: StateDict) -> StateDict:
        return dict(server_state)

    def new_aggregator(self, global_state: StateDict, server_state: StateDict) -> Aggregator:
        return Aggregator(global_state, server_state)

    # ---- client ----------------------------------------------------------------------------------

    def client_update(
        self,
        *,
        model: nn.Module,
        data: TrainData,
        cfg: LocalTrainConfig,
        server_extra: StateDict,
        client_state: StateDict,
        generator: torch.Generator,
    ) -> ClientUpdate:
        device = train_device(model, cfg)
        scale = float(server_extra["reg_scale"]) if "reg_scale" in server_extra else 0.0
        feature_gen = generator_from(server_extra).to(device) if scale > 0 else None
        distribution = server_extra.get("label_distribution")
        if feature_gen is not None and (distribution is None or not bool(torch.isfinite(distribution).all())
                                        or float(distribution.min()) < 0 or float(distribution.sum()) <= 0):
            raise WireError("fedgen: the task's label distribution is not a distribution")
        a, b = max(MIN_SCALE, self.alpha * scale), max(MIN_SCALE, self.beta * scale)

        def loss_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            features = model.features(x)
            logits = model.head(features)
            loss = F.cross_entropy(logits, y)
            if feature_gen is None:
                return loss
            sampled = torch.multinomial(distribution, len(y), replacement=True, generator=generator).to(device)
            with torch.no_grad():
                target = F.softmax(model.head(feature_gen(y, generator)[0]), dim=1)
                generated = feature_gen(sampled, generator)[0]
            latent = F.kl_div(F.log_softmax(logits, dim=1), target, reduction="batchmean")
            teacher = F.cross_entropy(model.head(generated), sampled)
            return loss + a * teacher + b * latent

        steps, train_loss = run_local_sgd(model, data, cfg, generator, loss_fn=loss_fn)
        return ClientUpdate(state=snapshot_state(model), num_steps=steps, train_loss=train_loss)
