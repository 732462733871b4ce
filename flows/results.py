"""One result store for every way of running: Prefect's persisted results (and so its cache) live in
our bucket under `prefect-results/`, through a prefect-aws S3Bucket block pointed at our endpoint.
A Retry, a rerun from the UI, a schedule or another host reuses finished work instead of redoing it.

The block holds no secret: processes find the S3 keys in their environment (AWS_ACCESS_KEY_ID /
AWS_SECRET_ACCESS_KEY, which the stage server and `dflash run` export from our settings).
"""

from __future__ import annotations

from dflash_core.layout import PREFECT_RESULTS_FOLDER
from dflash_core.services.stages import RESULTS_BLOCK
from dflash_core.settings import Settings


def save_result_storage(settings: Settings) -> str:
    """Create or update the S3Bucket block that results go to; its `type/name` slug."""
    from prefect_aws import AwsCredentials, S3Bucket
    from prefect_aws.client_parameters import AwsClientParameters

    credentials = AwsCredentials(region_name=settings.s3_region,
                                 aws_client_parameters=AwsClientParameters(endpoint_url=settings.s3_endpoint_url))
    bucket = S3Bucket(bucket_name=settings.s3_bucket, credentials=credentials, bucket_folder=PREFECT_RESULTS_FOLDER)
    bucket.save(RESULTS_BLOCK.split("/", 1)[1], overwrite=True)
    return RESULTS_BLOCK
