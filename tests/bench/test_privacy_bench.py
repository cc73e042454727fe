"""bench.privacy's dp_secagg arm: the step the real cohort protocol makes from the workers' updates."""
import torch

from bench.privacy import secure_dp_step
from privacy.dp import clip_update, update_norm
from privacy.secagg.noise import CohortNoise
from tests.helpers import make_adapter, random_like


def test_the_secure_dp_step_is_the_clipped_mean_plus_the_noise_the_members_added():
    updates = [random_like(make_adapter(rank=4), seed, scale=0.5) for seed in range(4)]
    clip = 1.0
    assert min(update_norm(u) for u in updates) > clip  # every update is clipped
    mean = {k: sum(clip_update(u, clip)[0][k] for u in updates) / 4 for k in updates[0]}
    quiet = secure_dp_step(updates, CohortNoise(noise_multiplier=1e-7, clip_norm=clip))
    assert max(float((quiet[k] - mean[k]).abs().max()) for k in mean) < 1e-6
    noisy = secure_dp_step(updates, CohortNoise(noise_multiplier=2.0, clip_norm=clip))
    noise = torch.cat([(noisy[k] - mean[k]).flatten() for k in mean])
    # sigma C / K = 0.5 per coordinate; 352 coordinates: 5 standard errors of the sample std is 19%
    assert abs(float(noise.std()) - 0.5) < 0.5 * 0.19
