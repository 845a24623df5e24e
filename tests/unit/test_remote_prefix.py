from etcd_agent.bucket.client import expand_prefix


def test_each_master_gets_its_own_folder():
    p = "etcd-backup/{cluster}/{host}/"
    assert expand_prefix(p, "prod", "master1.example.internal") == "etcd-backup/prod/master1/"
    assert expand_prefix(p, "prod", "master2") != expand_prefix(p, "prod", "master1")
    assert expand_prefix(p, "prod", "we ird/host") == "etcd-backup/prod/we_ird_host/"
    assert expand_prefix("flat/", "prod", "m1") == "flat/"
